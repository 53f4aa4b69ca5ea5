// A model's metrics per step, from its two sources, and the charts they make.
//
// - Checkpoint rows (deleted ones too: their metrics stay): what each training job reported
//   (loss, entropy, grad_norm, clip ratios, learning rate, tokens, ``train/reward`` ...) and
//   the summaries of batches logged at that step, merged in as ``<split>/<metric>``.
// - ``GET /v1/models/{id}/metrics``: the logged batches' summaries per step and split, every
//   batch of a step combined. They win over the merged copies, and also cover logged steps
//   that have no checkpoint.

import { get, getAll } from "./api.js";

// Shown first, in this order; everything else follows by name.
const PREFERRED = [
  "loss", "loss/policy", "loss/kl", "loss/sft", "entropy", "grad_norm", "learning_rate",
  "clip_ratio/low", "clip_ratio/high", "ratio/mean",
];
const SPREAD_KEYS = ["reward_std_dev", "reward_std"];
// Under "More metrics": the trainer's bookkeeping (packing, sequences, groups, timing) and
// the counts and extremes of logged batches.
const MAIN = new Set([...PREFERRED, "tokens/trainable", "train/num_trainable_tokens"]);
const LOGGED_BOOKKEEPING = new Set(["num_groups", "num_trajectories", "reward/min", "reward/max"]);

export async function loadHistory(modelId, signal) {
  const [points, checkpoints] = await Promise.all([
    get(`/v1/models/${encodeURIComponent(modelId)}/metrics`, { signal }),
    getAll(`/v1/models/${encodeURIComponent(modelId)}/checkpoints`, {
      params: { include_deleted: true },
      signal,
    }),
  ]);
  return { points: points.data, checkpoints };
}

// {splits: Set, values: Map<key, Map<step, number>>}
export function metricHistory({ points, checkpoints }) {
  const values = new Map();
  const set = (key, step, value) => {
    if (typeof value !== "number" || !Number.isFinite(value)) return;
    if (!values.has(key)) values.set(key, new Map());
    values.get(key).set(step, value);
  };
  for (const checkpoint of checkpoints) {
    for (const [key, value] of Object.entries(checkpoint.metrics)) set(key, checkpoint.step, value);
  }
  for (const point of points) {
    for (const [key, value] of Object.entries(point.metrics)) {
      set(`${point.split}/${key}`, point.step, value);
    }
  }
  return { splits: new Set(points.map((point) => point.split)), values };
}

function stepsOf(values, keys) {
  const steps = new Set();
  for (const key of keys) for (const step of values.get(key)?.keys() || []) steps.add(step);
  return [...steps].sort((a, b) => a - b);
}

function column(values, key, steps) {
  const byStep = values.get(key);
  return steps.map((step) => (byStep && byStep.has(step) ? byStep.get(step) : null));
}

function rank(name) {
  if (name === "reward") return -1;
  const index = PREFERRED.indexOf(name);
  return index === -1 ? PREFERRED.length : index;
}

function byRankThenName(a, b) {
  return rank(a.name) - rank(b.name) || a.name.localeCompare(b.name);
}

// One chart per metric: [{name, title, steps, series: [{label, values, band?}], section}],
// section "main" or "more".
// A metric logged under several splits is one chart with a series per split; the reward
// chart has train and val (and any other split), each with its mean ± std band.
export function modelCharts({ splits, values }) {
  const groups = new Map(); // chart name -> [{label, key}]
  const used = new Set();
  const rewardSplits = [...new Set(["train", "val", ...splits])].filter((split) =>
    values.has(`${split}/reward`));
  if (rewardSplits.length) {
    groups.set("reward", rewardSplits.map((split) => ({ label: split, key: `${split}/reward` })));
    for (const split of rewardSplits) {
      used.add(`${split}/reward`);
      for (const spread of SPREAD_KEYS) used.add(`${split}/${spread}`);
    }
  }
  for (const key of [...values.keys()].sort()) {
    if (used.has(key)) continue;
    const slash = key.indexOf("/");
    const split = slash > 0 ? key.slice(0, slash) : null;
    const [name, label] = split !== null && splits.has(split) ? [key.slice(slash + 1), split] : [key, key];
    if (!groups.has(name)) groups.set(name, []);
    groups.get(name).push({ label, key });
  }
  const charts = [...groups.entries()].map(([name, members]) => {
    const steps = stepsOf(values, members.map((member) => member.key));
    const series = members.map(({ label, key }) => {
      const mean = column(values, key, steps);
      const spreadKey = name === "reward" &&
        SPREAD_KEYS.map((spread) => `${label}/${spread}`).find((candidate) => values.has(candidate));
      if (!spreadKey) return { label, values: mean };
      const spread = column(values, spreadKey, steps);
      const lower = mean.map((m, i) => (m === null || spread[i] === null ? null : m - spread[i]));
      const upper = mean.map((m, i) => (m === null || spread[i] === null ? null : m + spread[i]));
      return { label, values: mean, band: { lower, upper } };
    });
    const logged = members.every(({ label }) => splits.has(label));
    const main = name === "reward" || MAIN.has(name) || (logged && !LOGGED_BOOKKEEPING.has(name));
    const title = name === "reward" ? "reward (mean ± std)" : name;
    return { name, title, steps, series, section: main ? "main" : "more" };
  });
  return charts.sort(byRankThenName);
}

// Several models' metrics: one chart per metric key, one series per model.
export function comparisonCharts(models, histories) {
  const keys = new Set();
  for (const history of histories) for (const key of history.values.keys()) keys.add(key);
  const charts = [...keys].map((key) => {
    const steps = [...new Set(histories.flatMap((history) =>
      [...(history.values.get(key)?.keys() || [])]))].sort((a, b) => a - b);
    const series = models.map((model, i) => ({
      label: model.name,
      values: column(histories[i].values, key, steps),
    }));
    return { name: key, title: key, steps, series };
  });
  const order = (chart) => rank(chart.name.endsWith("/reward") ? "reward" : chart.name);
  return charts.sort((a, b) => order(a) - order(b) || a.name.localeCompare(b.name));
}
