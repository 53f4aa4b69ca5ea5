// The runs (models) of one project on shared charts: one chart per metric, one line per run.

import { getAll, mapLimited } from "../api.js";
import { lineChart } from "../charts.js";
import { h, link, loading, replace } from "../dom.js";
import { comparisonCharts, loadHistory, metricHistory } from "../metrics.js";

const REFRESH_MS = 10000;
const MAX_SELECTED = 10; // more lines than this on one chart are hard to tell apart

export async function comparePage(root, context) {
  const { signal, query } = context;
  const project = query.get("project");
  if (!project) throw new Error("Choose a project to compare: #/compare?project=<name>.");
  context.setCrumbs([
    { label: "Models", href: link([]) },
    { label: project, href: link([], { project }) },
    { label: "Compare" },
  ]);
  replace(root, loading(`the runs of ${project}`));
  const models = await getAll("/v1/models", { params: { project }, signal });
  if (!models.length) throw new Error(`You have no models in project ${project}.`);
  const wanted = new Set((query.get("models") || "").split(",").filter(Boolean));
  const selected = new Set(
    models.filter((model) => (wanted.size ? wanted.has(model.id) : true)).slice(0, MAX_SELECTED).map((model) => model.id),
  );
  let histories = new Map();
  const grid = h("div", { class: "charts" });
  const charts = new Map();

  async function load() {
    const chosen = models.filter((model) => selected.has(model.id));
    const loaded = await mapLimited(chosen, 4, (model) => loadHistory(model.id, signal));
    histories = new Map(chosen.map((model, i) => [model.id, metricHistory(loaded[i])]));
  }

  function draw() {
    const chosen = models.filter((model) => histories.has(model.id));
    const definitions = comparisonCharts(chosen, chosen.map((model) => histories.get(model.id)));
    const names = new Set(definitions.map((definition) => definition.name));
    for (const [name, chart] of charts) {
      if (!names.has(name)) {
        chart.destroy();
        chart.element.remove();
        charts.delete(name);
      }
    }
    for (const definition of definitions) {
      let chart = charts.get(definition.name);
      if (chart) chart.update(definition.steps, definition.series);
      else {
        chart = lineChart(definition);
        charts.set(definition.name, chart);
      }
      grid.append(chart.element);
    }
  }

  const choices = h(
    "fieldset",
    { class: "run-choices" },
    h("legend", null, `Runs of ${project}`),
    models.map((model) => {
      const box = h("input", { type: "checkbox", id: `run-${model.id}`, checked: selected.has(model.id), value: model.id });
      box.addEventListener("change", async () => {
        if (box.checked) selected.add(model.id);
        else selected.delete(model.id);
        await load();
        draw();
      });
      return h("label", { for: `run-${model.id}` }, box, ` ${model.name}`);
    }),
  );
  await load();
  replace(root, h("h1", null, `Compare runs · ${project}`),
    h("p", { class: "muted small" }, "Each line is one model of the project. Drag across a chart to zoom in, double-click to zoom out."),
    choices, grid);
  draw();
  signal.addEventListener("abort", () => charts.forEach((chart) => chart.destroy()));
  context.every(REFRESH_MS, async () => {
    await load();
    draw();
  });
}
