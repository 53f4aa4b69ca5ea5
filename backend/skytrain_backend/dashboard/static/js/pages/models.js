// The tenant's models: name, base model, latest step, where each is served, whether it is
// training, last activity; filtered by project. Above them, the tenant's quotas in use
// (``GET /v1/usage``: models owned, bytes stored).

import { get, getAll, mapLimited } from "../api.js";
import { badge, formatAgo, formatTime, h, link, loading, replace, shortId } from "../dom.js";
import { formatBytes } from "./checkpoints.js";

const REFRESH_MS = 10000;

function usageLine(usage) {
  const quota = Object.fromEntries(usage.quotas.map((q) => [q.name, q]));
  const models = quota.max_models;
  const stored = quota.max_storage_bytes;
  return [
    `${usage.tenant}: ${models.used} of ${models.limit} models`,
    `${formatBytes(stored.used)} of ${formatBytes(stored.limit)} stored`,
  ].join(" · ");
}

async function openJobs(signal) {
  const [running, queued] = await Promise.all(
    ["running", "queued"].map((status) => get("/v1/training-jobs", { params: { status, limit: 100, order: "desc" }, signal })),
  );
  const byModel = new Map();
  for (const job of [...queued.data, ...running.data]) byModel.set(job.model_id, job);
  return byModel;
}

function servingCell(model) {
  const serving = model.serving;
  if (!serving) return h("td", { class: "muted" }, "–");
  return h(
    "td",
    { title: serving.message },
    badge(serving.state, serving.message),
    serving.worker_id ? h("span", { class: "muted small" }, ` worker ${shortId(serving.worker_id)}`) : null,
  );
}

function trainingCell(job) {
  if (!job) return h("td", { class: "muted" }, "–");
  return h("td", null, h("a", { href: link(["jobs", job.id]) }, badge(job.status === "running" ? "training" : "queued")));
}

function row(model, job) {
  return h(
    "tr",
    { dataset: { modelId: model.id } },
    h("th", { scope: "row" }, h("a", { href: link(["models", model.id]) }, model.name)),
    h("td", null, model.project),
    h("td", { class: "base-model", title: model.base_model }, model.base_model),
    h("td", { class: "num" }, String(model.latest_step)),
    servingCell(model),
    trainingCell(job),
    h("td", { title: formatTime(model.last_active_at) }, formatAgo(model.last_active_at)),
  );
}

export async function modelsPage(root, context) {
  const { signal, query } = context;
  const project = query.get("project") || "";
  context.setCrumbs([{ label: "Models", href: project ? link([]) : null }, ...(project ? [{ label: project }] : [])]);
  replace(root, loading("models"));

  let models = await getAll("/v1/models", { signal });
  const projects = [...new Set(models.map((model) => model.project))].sort();
  const select = h(
    "select",
    { id: "project-filter", onchange: (event) => { window.location.hash = link([], { project: event.target.value }); } },
    h("option", { value: "" }, "all projects"),
    projects.map((name) => h("option", { value: name }, name)),
  );
  select.value = project;
  const tbody = h("tbody");
  const table = h(
    "table",
    { class: "models" },
    h("caption", { class: "visually-hidden" }, "Models"),
    h("thead", null, h("tr", null, ["name", "project", "base model", "latest step", "serving", "training", "last activity"]
      .map((label) => h("th", { scope: "col" }, label)))),
    tbody,
  );
  const usage = h("p", { id: "usage", class: "muted small" });
  const empty = h("p", { class: "muted" }, "No models yet. Register one with the SDK: ",
    h("code", null, "await skytrain.TrainableModel(name=..., project=..., base_model=...).register(backend)"), ".");
  replace(
    root,
    h("div", { class: "toolbar" },
      h("h1", null, "Models"),
      h("label", { for: "project-filter" }, "Project "),
      select,
      project ? h("a", { class: "button-link", href: link(["compare"], { project }) }, `Compare the runs of ${project}`) : null),
    usage,
    table,
  );

  async function refresh() {
    const shown = project ? models.filter((model) => model.project === project) : models;
    // The list has no serving state: each model's own record has it.
    const [detailed, jobs, quotas] = await Promise.all([
      mapLimited(shown, 4, (model) => get(`/v1/models/${encodeURIComponent(model.id)}`, { signal })),
      openJobs(signal),
      get("/v1/usage", { signal }),
    ]);
    usage.textContent = usageLine(quotas);
    replace(tbody, detailed.map((model) => row(model, jobs.get(model.id))));
    if (!detailed.length) table.replaceWith(empty);
    else if (empty.isConnected) empty.replaceWith(table);
  }

  await refresh();
  context.every(REFRESH_MS, async () => {
    models = await getAll("/v1/models", { signal });
    await refresh();
  });
}
