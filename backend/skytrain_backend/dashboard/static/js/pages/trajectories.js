// The trajectory groups logged at one step of one split: each group's trajectories (sorted by
// reward if asked), each opening into its conversation. A trajectory's conversation is built
// only when it is opened, so a batch of hundreds stays quick.

import { get, getAll } from "../api.js";
import { keyValues, trajectoryBody } from "../conversation.js";
import { formatNumber, formatTime, h, link, loading, replace } from "../dom.js";

function lastAssistantText(trajectory) {
  const items = trajectory.messages_and_choices || [];
  for (let i = items.length - 1; i >= 0; i--) {
    const message = items[i] && ("message" in items[i] && !("role" in items[i]) ? items[i].message : items[i]);
    if (message && message.role === "assistant") {
      if (typeof message.content === "string" && message.content) return message.content;
      if (Array.isArray(message.tool_calls) && message.tool_calls.length) {
        return `tool call ${message.tool_calls.map((call) => call.function && call.function.name).join(", ")}`;
      }
    }
  }
  return "";
}

function trajectoryView(trajectory, index, options) {
  const metrics = Object.entries(trajectory.metrics || {}).slice(0, 3)
    .map(([key, value]) => `${key} ${typeof value === "number" ? formatNumber(value) : value}`);
  const preview = lastAssistantText(trajectory).replace(/\s+/g, " ").slice(0, 100);
  const details = h(
    "details",
    { class: "trajectory", dataset: { reward: String(trajectory.reward), index: String(index) } },
    h("summary", null,
      h("span", { class: "trajectory-index" }, `#${index + 1}`),
      h("span", { class: "reward" }, "reward ", h("strong", null, formatNumber(trajectory.reward))),
      metrics.length ? h("span", { class: "muted" }, ` · ${metrics.join(" · ")}`) : null,
      preview ? h("span", { class: "preview" }, preview) : null),
  );
  details.addEventListener("toggle", () => {
    if (details.open && details.childElementCount === 1) details.append(trajectoryBody(trajectory, options));
  });
  return details;
}

function groupView(group, index, options) {
  const trajectories = group.trajectories.map((trajectory, i) => ({ trajectory, i }));
  if (options.sortByReward) trajectories.sort((a, b) => b.trajectory.reward - a.trajectory.reward);
  const rewards = group.trajectories.map((trajectory) => trajectory.reward);
  const mean = rewards.reduce((sum, reward) => sum + reward, 0) / Math.max(rewards.length, 1);
  const exceptions = group.exceptions || [];
  return h(
    "section",
    { class: "card group", dataset: { group: String(index) } },
    h("h3", null, `Group ${index + 1}`),
    h("p", { class: "muted" }, `${rewards.length} trajectories · reward mean ${formatNumber(mean)}, `,
      `min ${formatNumber(Math.min(...rewards))}, max ${formatNumber(Math.max(...rewards))}`),
    h("div", { class: "key-value-row" }, keyValues("metrics", group.metrics), keyValues("metadata", group.metadata)),
    exceptions.length
      ? h("details", { class: "exceptions" }, h("summary", null, `${exceptions.length} rollouts failed`),
        h("ul", null, exceptions.map((exception) =>
          h("li", null, h("code", null, String(exception.type || "error")), ` ${exception.message || ""}`))))
      : null,
    trajectories.map(({ trajectory, i }) => trajectoryView(trajectory, i, options)),
  );
}

export async function trajectoriesTab(container, context, model) {
  const { signal, query } = context;
  const base = `/v1/models/${encodeURIComponent(model.id)}`;
  replace(container, loading("logged trajectories"));
  const points = (await get(`${base}/metrics`, { signal })).data;
  if (!points.length) {
    replace(container, h("p", { class: "muted" }, "No logged trajectories yet: log groups with ",
      h("code", null, "model.log(groups, split=\"val\")"), "."));
    return null;
  }
  const splits = [...new Set(points.map((point) => point.split))].sort();
  const split = splits.includes(query.get("split")) ? query.get("split") : (splits.includes("val") ? "val" : splits[0]);
  const steps = points.filter((point) => point.split === split).map((point) => point.step).sort((a, b) => b - a);
  const wanted = Number.parseInt(query.get("step"), 10);
  const step = steps.includes(wanted) ? wanted : steps[0];
  const batches = await getAll(`${base}/logs`, { params: { split, step }, signal });
  const batch = batches.find((item) => item.id === query.get("batch")) || batches[0];
  const go = (change) => {
    window.location.hash = link(["models", model.id, "trajectories"], { split, step, ...change });
  };

  const index = steps.indexOf(step);
  const controls = h(
    "div",
    { class: "toolbar" },
    h("label", { for: "split-select" }, "Split "),
    h("select", { id: "split-select", onchange: (event) => go({ split: event.target.value, step: undefined }) },
      splits.map((name) => h("option", { value: name, selected: name === split }, name))),
    h("button", { type: "button", class: "quiet", disabled: index >= steps.length - 1, onclick: () => go({ step: steps[index + 1] }) }, "← earlier"),
    h("label", { for: "step-select" }, "Step "),
    h("select", { id: "step-select", onchange: (event) => go({ step: event.target.value }) },
      steps.map((value) => h("option", { value: String(value), selected: value === step }, String(value)))),
    h("button", { type: "button", class: "quiet", disabled: index <= 0, onclick: () => go({ step: steps[index - 1] }) }, "later →"),
    batches.length > 1
      ? [h("label", { for: "batch-select" }, "Batch "),
        h("select", { id: "batch-select", onchange: (event) => go({ batch: event.target.value }) },
          batches.map((item) => h("option", { value: item.id, selected: item.id === batch.id },
            `${formatTime(item.created_at)} · ${item.num_trajectories} trajectories`)))]
      : null,
  );
  const sortBox = h("input", { id: "sort-by-reward", type: "checkbox", checked: true });
  const shadeBox = h("input", { id: "shade-tokens", type: "checkbox", checked: true });
  const options = h(
    "div",
    { class: "toolbar options" },
    h("label", null, sortBox, " Sort by reward within each group"),
    h("label", null, shadeBox, " Shade sampled tokens by logprob"),
    h("span", { class: "legend-tokens muted small" }, "darker = less likely"),
  );
  const groups = h("div", { class: "groups" });
  const pending = loading("the batch");
  replace(container, controls, options, pending, groups);
  const detail = await get(`${base}/logs/${encodeURIComponent(batch.id)}`, { signal });
  pending.remove();

  function draw() {
    const settings = { sortByReward: sortBox.checked, shade: shadeBox.checked };
    replace(groups,
      h("p", { class: "muted" }, `Step ${step}, split ${split}: ${detail.num_groups} groups, `,
        `${detail.num_trajectories} trajectories, reward ${formatNumber(detail.metrics.reward)} `,
        `(logged ${formatTime(detail.created_at)}).`),
      detail.trajectory_groups.map((group, i) => groupView(group, i, settings)));
  }
  sortBox.addEventListener("change", draw);
  shadeBox.addEventListener("change", draw);
  draw();
  return null;
}
