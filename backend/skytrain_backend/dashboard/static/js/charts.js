// Line charts of a metric per step, drawn by uPlot (shipped in /dashboard/vendor/uplot).
//
// A chart is a card: a title, the plot (drag across it to zoom in, double-click to zoom out)
// and its numbers in a table under "Data" (what a screen reader or a test reads). The card's
// element keeps its uPlot instance as ``element.uplot``.

import { formatNumber, h, replace } from "./dom.js";

const PALETTE = [
  "#2563eb", "#ea580c", "#16a34a", "#9333ea", "#dc2626",
  "#0891b2", "#ca8a04", "#db2777", "#4b5563", "#65a30d",
];
const HEIGHT = 220;
const STEP_INCREMENTS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000];

export function color(index) {
  return PALETTE[index % PALETTE.length];
}

// uPlot steps its ticks by its own increments; over a range far narrower than the numbers
// themselves (a ratio of 0.99999976 to 0.99999992) that search never ends. Differences that
// small are rounding noise on a chart: the y range spans at least a thousandth of the values
// (and -0.5 to 0.5 around zero).
function yRange(_, min, max) {
  const magnitude = Math.max(Math.abs(min), Math.abs(max));
  const span = magnitude === 0 ? 1 : Math.max(magnitude * 1e-3, 1e-9);
  if (max - min < span) {
    const middle = (min + max) / 2;
    return window.uPlot.rangeNum(middle - span / 2, middle + span / 2, 0.1, true);
  }
  return window.uPlot.rangeNum(min, max, 0.1, true);
}

// Room for the longest tick label (uPlot's fixed default cuts off "2.471e-7").
function axisSize(u, values, axisIndex, cycle) {
  const axis = u.axes[axisIndex];
  const longest = (values || []).reduce((found, value) => (String(value).length > found.length ? String(value) : found), "");
  u.ctx.font = axis.font[0];
  const size = Math.ceil(axis.ticks.size + axis.gap + u.ctx.measureText(longest).width / window.devicePixelRatio) + 4;
  // Never shrink once laid out: sizes that only grow settle in uPlot's few layout passes.
  return cycle > 1 ? Math.max(size, axis._size) : size;
}

// Tick labels: as uPlot rounded them, in exponent form when very small or large.
function tickLabel(value) {
  const magnitude = Math.abs(value);
  if (magnitude !== 0 && (magnitude < 1e-3 || magnitude >= 1e6)) return value.toExponential(2);
  return String(value);
}

function translucent(hex, alpha) {
  const value = parseInt(hex.slice(1), 16);
  return `rgba(${value >> 16}, ${(value >> 8) & 255}, ${value & 255}, ${alpha})`;
}

// series: [{label, values: [number|null per step], band: {lower, upper} (optional)}]
function plotSpec(steps, series, axis) {
  const data = [steps];
  const specs = [{ label: axis, value: (_, value) => (value === null ? "–" : String(value)) }];
  const bands = [];
  series.forEach((item, index) => {
    data.push(item.values);
    specs.push({
      label: item.label,
      stroke: color(index),
      width: 2,
      spanGaps: true,
      value: (_, value) => formatNumber(value),
    });
  });
  series.forEach((item, index) => {
    if (!item.band) return;
    const dashed = {
      class: "band-edge", // drawn, left out of the legend
      stroke: translucent(color(index), 0.6),
      width: 1,
      dash: [4, 4],
      spanGaps: true,
      points: { show: false },
      value: (_, value) => formatNumber(value),
    };
    data.push(item.band.upper, item.band.lower);
    specs.push({ ...dashed, label: `${item.label} + std` }, { ...dashed, label: `${item.label} − std` });
    bands.push({ series: [specs.length - 2, specs.length - 1], fill: translucent(color(index), 0.12) });
  });
  return { data, specs, bands };
}

function dataTable(steps, series, axis) {
  const header = h("tr", null, h("th", { scope: "col" }, axis),
    series.map((item) => h("th", { scope: "col" }, item.label)));
  const rows = steps.map((step, row) => h("tr", null, h("th", { scope: "row" }, String(step)),
    series.map((item) => h("td", null, formatNumber(item.values[row])))));
  return h("table", { class: "data" }, h("thead", null, header), h("tbody", null, rows));
}

// A chart card; ``update(steps, series)`` redraws it with new data (keeping a zoom).
export function lineChart({ name, title, steps, series, note, axis = "step" }) {
  const canvas = h("div", { class: "chart-canvas" });
  const details = h("details", { class: "chart-data" }, h("summary", null, "Data"));
  const element = h(
    "section",
    { class: "card chart", dataset: { chart: name } },
    h("h3", null, title),
    note ? h("p", { class: "muted small" }, note) : null,
    canvas,
    details,
  );
  let current = { steps, series };
  let plot = null;
  let zoomed = false;

  function build(width) {
    const { data, specs, bands } = plotSpec(current.steps, current.series, axis);
    plot?.destroy();
    plot = new window.uPlot(
      {
        width,
        height: HEIGHT,
        scales: { x: { time: false }, y: { range: yRange } },
        series: specs,
        bands,
        axes: [
          { label: axis, incrs: STEP_INCREMENTS },
          { size: axisSize, values: (_, ticks) => ticks.map(tickLabel) },
        ],
        cursor: { drag: { x: true, y: false } },
        hooks: { setSelect: [() => { zoomed = true; }] },
      },
      data,
      canvas,
    );
    element.uplot = plot;
  }

  canvas.addEventListener("dblclick", () => {
    zoomed = false;
  });
  const resize = new ResizeObserver(() => {
    const width = Math.floor(canvas.clientWidth);
    if (width <= 0) return;
    if (plot === null) build(width);
    else if (plot.width !== width) plot.setSize({ width, height: HEIGHT });
  });
  resize.observe(canvas);

  details.addEventListener("toggle", () => {
    if (details.open) {
      replace(details, h("summary", null, "Data"), dataTable(current.steps, current.series, axis));
    }
  });

  function update(newSteps, newSeries) {
    const sameShape =
      newSeries.length === current.series.length &&
      newSeries.every((item, i) => item.label === current.series[i].label &&
        Boolean(item.band) === Boolean(current.series[i].band));
    current = { steps: newSteps, series: newSeries };
    if (details.open) {
      replace(details, h("summary", null, "Data"), dataTable(current.steps, current.series, axis));
    }
    if (plot === null) return;
    if (!sameShape) {
      build(plot.width);
      return;
    }
    plot.setData(plotSpec(newSteps, newSeries, axis).data, !zoomed);
  }

  function destroy() {
    resize.disconnect();
    plot?.destroy();
  }

  return { element, update, destroy };
}
