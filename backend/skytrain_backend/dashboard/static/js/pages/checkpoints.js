// A model's checkpoints, newest first: metrics, the name to sample a step by, its files.

import { get, PAGE_LIMIT, request } from "../api.js";
import { copyable, formatNumber, formatTime, h, loading, replace } from "../dom.js";

// Shown in the table; every metric is under "all metrics".
const HEADLINE = ["val/reward", "train/reward", "loss/policy", "loss"];

export function formatBytes(size) {
  if (size < 1024) return `${size} B`;
  if (size < 1024 ** 2) return `${(size / 1024).toFixed(1)} KiB`;
  if (size < 1024 ** 3) return `${(size / 1024 ** 2).toFixed(1)} MiB`;
  return `${(size / 1024 ** 3).toFixed(2)} GiB`;
}

// Fetch the file through the API (the key goes in a header, which a plain link cannot send)
// and hand it to the browser as a download.
async function download(path, name, button) {
  const label = button.textContent;
  button.disabled = true;
  button.textContent = `downloading ${name}…`;
  try {
    const response = await request(path, { params: { redirect: false }, accept: "application/octet-stream" });
    const url = URL.createObjectURL(await response.blob());
    const anchor = h("a", { href: url, download: name.split("/").pop(), hidden: true });
    document.body.append(anchor);
    anchor.click();
    anchor.remove();
    setTimeout(() => URL.revokeObjectURL(url), 60000);
    button.textContent = label;
  } catch (error) {
    button.textContent = `${label}: ${error.message}`;
  } finally {
    button.disabled = false;
  }
}

function filesCell(model, checkpoint) {
  const cell = h("td", { class: "files" });
  if (checkpoint.deleted_at) {
    cell.append(h("span", { class: "muted" }, `deleted ${formatTime(checkpoint.deleted_at)}`));
    return cell;
  }
  if (checkpoint.step === 0) {
    cell.append(h("span", { class: "muted" }, "the base model (no files)"));
    return cell;
  }
  const base = `/v1/models/${encodeURIComponent(model.id)}/checkpoints/${checkpoint.step}/files`;
  const show = h("button", { type: "button", class: "quiet" }, "Files");
  show.addEventListener("click", async () => {
    show.disabled = true;
    try {
      const files = (await get(base)).data;
      replace(cell, h("ul", { class: "file-list" }, files.map((file) => {
        const button = h("button", { type: "button", class: "link-button", dataset: { file: file.name } },
          `${file.name} (${formatBytes(file.size)})`);
        button.addEventListener("click", () =>
          download(`${base}/${file.name.split("/").map(encodeURIComponent).join("/")}`, file.name, button));
        return h("li", null, button);
      })));
    } catch (error) {
      show.disabled = false;
      show.textContent = `Files: ${error.message}`;
    }
  });
  cell.append(show);
  return cell;
}

function metricsCell(checkpoint) {
  const entries = Object.entries(checkpoint.metrics).sort(([a], [b]) => a.localeCompare(b));
  const headline = HEADLINE.filter((key) => key in checkpoint.metrics)
    .map((key) => h("span", { class: "metric" }, `${key} `, h("strong", null, formatNumber(checkpoint.metrics[key]))));
  return h(
    "td",
    { class: "metrics-cell" },
    headline,
    entries.length
      ? h("details", null, h("summary", null, `all metrics (${entries.length})`),
        h("dl", { class: "compact" }, entries.map(([key, value]) => [h("dt", null, key), h("dd", null, formatNumber(value))])))
      : h("span", { class: "muted" }, "–"),
  );
}

function row(model, checkpoint) {
  return h(
    "tr",
    { class: checkpoint.deleted_at ? "deleted" : null, dataset: { step: String(checkpoint.step) } },
    h("th", { scope: "row", class: "num" }, String(checkpoint.step)),
    h("td", null, formatTime(checkpoint.created_at)),
    metricsCell(checkpoint),
    h("td", null, checkpoint.deleted_at
      ? h("span", { class: "muted" }, "–")
      : copyable(`${model.inference_name}:step${checkpoint.step}`, `inference name of step ${checkpoint.step}`)),
    filesCell(model, checkpoint),
  );
}

export async function checkpointsTab(container, context, model) {
  const { signal } = context;
  const path = `/v1/models/${encodeURIComponent(model.id)}/checkpoints`;
  const params = { include_deleted: true, order: "desc", limit: PAGE_LIMIT };
  replace(container, loading("checkpoints"));
  const tbody = h("tbody");
  const more = h("button", { type: "button", class: "quiet", hidden: true }, "Load more");
  let last = null;
  let newest = -1;

  async function loadPage() {
    const page = await get(path, { params: { ...params, after: last ? last.id : undefined }, signal });
    for (const checkpoint of page.data) tbody.append(row(model, checkpoint));
    if (page.data.length) {
      last = page.data[page.data.length - 1];
      newest = Math.max(newest, page.data[0].step);
    }
    more.hidden = !page.has_more;
  }
  more.addEventListener("click", () => loadPage());
  await loadPage();
  replace(
    container,
    h("p", { class: "muted small" }, "Sample a step with its inference name as ",
      h("code", null, "model"), " in /v1/chat/completions. Deleted steps keep their metrics."),
    h("table", { class: "checkpoints" },
      h("thead", null, h("tr", null, ["step", "created", "metrics", "inference name", "files"]
        .map((label) => h("th", { scope: "col" }, label)))),
      tbody),
    more,
  );
  return {
    async refresh(current) {
      if (current.latest_step <= newest) return;
      const page = await get(path, { params: { ...params, limit: 20 }, signal });
      const fresh = page.data.filter((checkpoint) => checkpoint.step > newest).reverse();
      for (const checkpoint of fresh) tbody.prepend(row(model, checkpoint));
      if (fresh.length) newest = fresh[fresh.length - 1].step;
    },
  };
}
