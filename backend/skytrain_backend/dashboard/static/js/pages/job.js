// One training job: status, progress, failure message and its events as they arrive (read
// with the events cursor every second until the job has ended and its last event is in).

import { get, PAGE_LIMIT } from "../api.js";
import { lineChart } from "../charts.js";
import { badge, errorBox, formatDuration, formatNumber, formatTime, h, link, loading, replace, shortId } from "../dom.js";

const REFRESH_MS = 1000;
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
const PREFERRED_METRICS = ["loss/policy", "loss", "loss/sft", "grad_norm", "entropy"];

function eventData(data) {
  const entries = Object.entries(data || {});
  if (!entries.length) return "";
  return entries
    .map(([key, value]) => `${key}=${typeof value === "number" ? formatNumber(value) : JSON.stringify(value)}`)
    .join("  ");
}

function eventRow(event) {
  return h(
    "tr",
    { class: `event event-${event.type}`, dataset: { eventId: event.id, type: event.type } },
    h("td", { class: "num" }, event.id),
    h("td", { title: formatTime(event.created_at) }, new Date(event.created_at).toLocaleTimeString("en-GB")),
    h("th", { scope: "row" }, event.type),
    h("td", { class: "event-data" }, eventData(event.data)),
  );
}

function facts(job, model) {
  return h(
    "dl",
    { class: "facts" },
    h("dt", null, "status"), h("dd", { id: "job-status", dataset: { status: job.status } }, badge(job.status),
      job.cancel_requested ? " (cancel requested)" : null),
    h("dt", null, "model"), h("dd", null, h("a", { href: link(["models", model.id, "jobs"]) }, model.inference_name)),
    h("dt", null, "kind"), h("dd", null, job.kind),
    h("dt", null, "input"), h("dd", null, job.kind === "rl"
      ? `${job.num_groups} groups, ${job.num_trajectories} trajectories`
      : `${job.num_trajectories} trajectories`),
    h("dt", null, "attempts"), h("dd", null, String(job.attempts),
      job.preemptions ? ` (${job.preemptions} yielded the worker to another tenant's job)` : null),
    h("dt", null, "created"), h("dd", null, formatTime(job.created_at)),
    h("dt", null, "started"), h("dd", null, formatTime(job.started_at)),
    h("dt", null, "took"), h("dd", null, job.started_at ? formatDuration(job.started_at, job.finished_at) : "–"),
    h("dt", null, "step produced"), h("dd", null, job.step === null ? "–"
      : h("a", { href: link(["models", model.id, "checkpoints"]) }, `step ${job.step}`)),
  );
}

export async function jobPage(root, context) {
  const { signal } = context;
  const jobId = context.parts[1];
  const path = `/v1/training-jobs/${encodeURIComponent(jobId)}`;
  replace(root, loading("the job"));
  let job = await get(path, { signal });
  const model = await get(`/v1/models/${encodeURIComponent(job.model_id)}`, { signal });
  context.setCrumbs([
    { label: "Models", href: link([]) },
    { label: model.name, href: link(["models", model.id]) },
    { label: "Jobs", href: link(["models", model.id, "jobs"]) },
    { label: shortId(job.id) },
  ]);
  document.title = `job ${shortId(job.id)} · skytrain`;

  const header = h("div", null, facts(job, model));
  const failure = h("div");
  const progress = h("progress", { id: "job-progress", max: 1, value: 0 });
  const progressText = h("span", { class: "muted", role: "status" }, "");
  const events = h("tbody");
  const metricSelect = h("select", { id: "job-metric" });
  const metricRow = h("div", { class: "toolbar", hidden: true }, h("label", { for: "job-metric" }, "Metric "), metricSelect);
  const chartSlot = h("div");
  let chart = null;
  const steps = []; // gradient_step events' data, in order (a new attempt starts over)
  let expected = null;
  let yielded = false; // handed the worker to another tenant's job; resumes where it stopped
  let cursor = null;

  function showFailure() {
    replace(failure, job.error ? errorBox(new Error(job.error)) : null);
  }

  function drawProgress() {
    progress.max = expected || Math.max(steps.length, 1);
    progress.value = steps.length;
    progressText.textContent = expected === null
      ? (TERMINAL.has(job.status) ? "" : "waiting for the worker to start training")
      : `${steps.length} of ${expected} gradient steps`
        + (yielded && !TERMINAL.has(job.status)
          ? ": yielded the worker to another tenant's job, resumes from here" : "");
    const keys = [...new Set(steps.flatMap((data) => Object.keys(data).filter((key) => typeof data[key] === "number" && key !== "step")))];
    metricRow.hidden = keys.length === 0;
    if (!keys.length) return;
    if (metricSelect.options.length !== keys.length) {
      const chosen = metricSelect.value || PREFERRED_METRICS.find((key) => keys.includes(key)) || keys[0];
      replace(metricSelect, keys.sort().map((key) => h("option", { value: key, selected: key === chosen }, key)));
      metricSelect.value = chosen;
    }
    const key = metricSelect.value;
    const x = steps.map((_, i) => i + 1);
    const series = [{ label: key, values: steps.map((data) => (typeof data[key] === "number" ? data[key] : null)) }];
    if (chart === null) {
      chart = lineChart({ name: "gradient-steps", title: "per gradient step", steps: x, series, axis: "gradient step" });
      replace(chartSlot, chart.element);
      signal.addEventListener("abort", () => chart.destroy());
    } else {
      chart.update(x, series);
    }
  }
  metricSelect.addEventListener("change", drawProgress);

  async function readEvents() {
    for (;;) {
      const page = await get(`${path}/events`, { params: { after: cursor, limit: PAGE_LIMIT }, signal });
      for (const event of page.data) {
        cursor = event.id;
        events.append(eventRow(event));
        if (event.type === "training_started") {
          steps.length = 0;
          expected = event.data.num_gradient_steps ?? null;
        } else if (event.type === "training_preempted") {
          yielded = true;
        } else if (event.type === "training_resumed") {
          // From the state saved after that step: later steps of a lost attempt run again.
          steps.length = Math.min(steps.length, event.data.steps_done ?? steps.length);
          expected = event.data.num_gradient_steps ?? expected;
          yielded = false;
        } else if (event.type === "gradient_step") {
          steps.push(event.data);
        }
      }
      if (!page.has_more) return;
    }
  }

  await readEvents();
  replace(
    root,
    h("h1", null, `Training job ${shortId(job.id)}`, h("span", { class: "muted" }, ` ${job.id}`)),
    header,
    failure,
    h("div", { class: "progress-row" }, h("label", { for: "job-progress" }, "Progress "), progress, " ", progressText),
    metricRow,
    chartSlot,
    h("h2", null, "Events"),
    h("table", { class: "events" },
      h("thead", null, h("tr", null, ["id", "time", "type", "data"].map((label) => h("th", { scope: "col" }, label)))),
      events),
    h("details", { class: "config" }, h("summary", null, "config"), h("pre", null, JSON.stringify(job.config, null, 2))),
  );
  showFailure();
  drawProgress();

  let finished = TERMINAL.has(job.status);
  context.every(REFRESH_MS, async () => {
    if (finished) return;
    // The status first: events written before it changed are then all readable.
    job = await get(path, { signal });
    await readEvents();
    finished = TERMINAL.has(job.status);
    replace(header, facts(job, model));
    showFailure();
    drawProgress();
  });
}
