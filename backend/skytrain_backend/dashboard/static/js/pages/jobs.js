// A model's training jobs, newest first, with their status and failure messages.

import { get } from "../api.js";
import { badge, formatDuration, formatTime, h, link, loading, replace, shortId } from "../dom.js";

const PAGE = 50;

function row(job) {
  return h(
    "tr",
    { dataset: { jobId: job.id } },
    h("th", { scope: "row" }, h("a", { href: link(["jobs", job.id]) }, shortId(job.id))),
    h("td", null, job.kind),
    h("td", null, badge(job.status)),
    h("td", { class: "num" }, job.step === null ? "–" : String(job.step)),
    h("td", { class: "num" }, String(job.num_trajectories)),
    h("td", { class: "num" }, String(job.attempts)),
    h("td", null, formatTime(job.created_at)),
    h("td", null, formatDuration(job.started_at, job.finished_at)),
    h("td", { class: "job-error" }, job.error || ""),
  );
}

export async function jobsTab(container, context, model) {
  const { signal } = context;
  const params = { model_id: model.id, order: "desc", limit: PAGE };
  replace(container, loading("jobs"));
  const tbody = h("tbody");
  const table = h("table", { class: "jobs" },
    h("thead", null, h("tr", null, ["job", "kind", "status", "step", "trajectories", "attempts", "created", "took", "error"]
      .map((label) => h("th", { scope: "col" }, label)))),
    tbody);
  const empty = h("p", { class: "muted" }, "No training jobs yet: model.train(groups) starts one.");
  const more = h("button", { type: "button", class: "quiet", hidden: true }, "Load more");
  let newest = []; // the first page, read again on every refresh
  let older = []; // pages loaded with "Load more"
  let hasMore = false;

  function draw() {
    const ids = new Set(newest.map((job) => job.id));
    const jobs = [...newest, ...older.filter((job) => !ids.has(job.id))];
    replace(tbody, jobs.map(row));
    table.hidden = jobs.length === 0;
    empty.hidden = jobs.length > 0;
    more.hidden = !hasMore;
  }
  async function loadNewest() {
    const page = await get("/v1/training-jobs", { params, signal });
    newest = page.data;
    if (!older.length) hasMore = page.has_more;
    draw();
  }
  more.addEventListener("click", async () => {
    const last = (older.length ? older : newest).at(-1);
    const page = await get("/v1/training-jobs", { params: { ...params, after: last.id }, signal });
    older.push(...page.data);
    hasMore = page.has_more;
    draw();
  });
  await loadNewest();
  replace(container, empty, table, more);
  return { refresh: loadNewest };
}
