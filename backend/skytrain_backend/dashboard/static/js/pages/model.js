// A model's page: what it is and where it is served, then one of five tabs: its metrics per
// step (charts that update while it trains), logged trajectories, checkpoints, jobs, and the
// workers that serve it with the scheduler's scale events.

import { get } from "../api.js";
import { lineChart } from "../charts.js";
import { badge, copyable, formatAgo, formatTime, h, link, loading, replace, shortId } from "../dom.js";
import { loadHistory, metricHistory, modelCharts } from "../metrics.js";
import { checkpointsTab } from "./checkpoints.js";
import { jobsTab } from "./jobs.js";
import { replicaCount, replicasTab } from "./replicas.js";
import { trajectoriesTab } from "./trajectories.js";

const REFRESH_MS = 5000;
const TABS = [
  ["metrics", "Metrics"],
  ["trajectories", "Trajectories"],
  ["checkpoints", "Checkpoints"],
  ["jobs", "Jobs"],
  ["replicas", "Replicas"],
];

async function openJob(modelId, signal) {
  for (const status of ["running", "queued"]) {
    const page = await get("/v1/training-jobs", { params: { model_id: modelId, status, limit: 1 }, signal });
    if (page.data.length) return page.data[0];
  }
  return null;
}

function summary(model, job) {
  const serving = model.serving;
  return h(
    "div",
    { class: "model-summary" },
    h("dl", { class: "facts" },
      h("dt", null, "inference name"), h("dd", null, copyable(model.inference_name, "inference name")),
      h("dt", null, "base model"), h("dd", null, model.base_model),
      h("dt", null, "latest step"), h("dd", { class: "latest-step" }, String(model.latest_step)),
      h("dt", null, "serving"),
      h("dd", null, serving ? [badge(serving.state), " ", h("span", { class: "muted" }, serving.message)] : "–"),
      h("dt", null, "replicas"),
      h("dd", { class: "replicas-summary" }, h("a", { href: link(["models", model.id, "replicas"]) }, replicaCount(model))),
      h("dt", null, "last activity"),
      h("dd", { title: formatTime(model.last_active_at) }, formatAgo(model.last_active_at)),
      h("dt", null, "created"), h("dd", null, formatTime(model.created_at))),
    job
      ? h("p", { class: "notice" }, `Training job `, h("a", { href: link(["jobs", job.id]) }, shortId(job.id)),
        ` is ${job.status}.`)
      : null,
  );
}

async function metricsTab(container, context, model) {
  const { signal } = context;
  replace(container, loading("metrics"));
  const grid = h("div", { class: "charts" });
  const moreGrid = h("div", { class: "charts" });
  const moreSummary = h("summary", null, "More metrics");
  const more = h("details", { class: "more-metrics", hidden: true }, moreSummary, moreGrid);
  const empty = h("p", { class: "muted" }, "No metrics yet: they appear when the model trains ",
    "(model.train) or logs trajectories (model.log).");
  const charts = new Map();

  function draw(history) {
    const definitions = modelCharts(metricHistory(history));
    for (const definition of definitions) {
      const existing = charts.get(definition.name);
      if (existing) {
        existing.update(definition.steps, definition.series);
      } else {
        charts.set(definition.name, lineChart(definition));
      }
    }
    // Keep the cards in the charts' order (a new metric can appear in the middle).
    for (const definition of definitions) {
      (definition.section === "main" ? grid : moreGrid).append(charts.get(definition.name).element);
    }
    const extra = definitions.filter((definition) => definition.section === "more");
    more.hidden = extra.length === 0;
    moreSummary.textContent = `More metrics (${extra.length}): ${extra.map((d) => d.name).join(", ")}`;
    if (definitions.length && empty.isConnected) empty.remove();
  }

  const marker = async (latestStep) => {
    const newest = await get(`/v1/models/${encodeURIComponent(model.id)}/logs`, {
      params: { limit: 1, order: "desc" },
      signal,
    });
    return `${latestStep}/${newest.data.length ? newest.data[0].id : ""}`;
  };
  // What the charts show changes with a new checkpoint or a new logged batch.
  let seen = await marker(model.latest_step);
  draw(await loadHistory(model.id, signal));
  replace(
    container,
    h("p", { class: "muted small" }, "One point per step. Drag across a chart to zoom in, double-click to zoom out. ",
      h("a", { href: link(["compare"], { project: model.project }) }, `Compare the runs of ${model.project}`), "."),
    charts.size ? null : empty,
    grid,
    more,
  );
  signal.addEventListener("abort", () => charts.forEach((chart) => chart.destroy()));

  return {
    async refresh(current) {
      const now = await marker(current.latest_step);
      if (now === seen) return;
      draw(await loadHistory(model.id, signal));
      seen = now;
    },
  };
}

const TAB_VIEWS = {
  metrics: metricsTab,
  trajectories: trajectoriesTab,
  checkpoints: checkpointsTab,
  jobs: jobsTab,
  replicas: replicasTab,
};

export async function modelPage(root, context) {
  const { signal } = context;
  const [, modelId, tab = "metrics"] = context.parts;
  const view = TAB_VIEWS[tab];
  if (!view) throw new Error(`A model has no tab ${tab}: its tabs are ${Object.keys(TAB_VIEWS).join(", ")}.`);
  replace(root, loading("the model"));
  let [model, job] = await Promise.all([
    get(`/v1/models/${encodeURIComponent(modelId)}`, { signal }),
    openJob(modelId, signal),
  ]);
  context.setCrumbs([
    { label: "Models", href: link([]) },
    { label: model.project, href: link([], { project: model.project }) },
    { label: model.name },
  ]);
  document.title = `${model.name} · skytrain`;
  const header = h("div", null, summary(model, job));
  const tabs = h(
    "nav",
    { class: "tabs", "aria-label": "Model views" },
    TABS.map(([name, label]) => h(
      "a",
      { href: link(["models", model.id, ...(name === "metrics" ? [] : [name])]), "aria-current": name === tab ? "page" : null },
      label,
    )),
  );
  const content = h("div", { class: "tab-content", dataset: { tab } });
  replace(root, h("h1", { class: "model-name" }, model.name, h("span", { class: "muted" }, ` ${model.entity}/${model.project}`)),
    header, tabs, content);
  const active = await view(content, context, model);

  context.every(REFRESH_MS, async () => {
    [model, job] = await Promise.all([
      get(`/v1/models/${encodeURIComponent(modelId)}`, { signal }),
      openJob(modelId, signal),
    ]);
    replace(header, summary(model, job));
    if (active && active.refresh) await active.refresh(model, job);
  });
}
