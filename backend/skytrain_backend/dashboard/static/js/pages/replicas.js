// A model's replicas: the workers that serve it now (its home, which trains it, and the
// replicas beside it) and the scheduler's scale events, newest first, each with its reason.

import { get } from "../api.js";
import { badge, formatAgo, formatTime, h, loading, replace } from "../dom.js";

function replicaRow(replica) {
  return h(
    "tr",
    { dataset: { workerId: replica.worker_id, role: replica.role } },
    h("th", { scope: "row" }, replica.worker_id),
    h("td", null, replica.role),
    h("td", null, badge(replica.status)),
    h("td", { class: "num" }, String(replica.in_flight ?? 0)),
  );
}

function eventRow(event) {
  return h(
    "tr",
    { dataset: { kind: event.kind } },
    h("td", { title: formatTime(event.created_at) }, formatAgo(event.created_at)),
    h("td", null, event.kind),
    h("td", { class: "num" }, String(event.replicas)),
    h("td", null, event.worker_id || "–"),
    h("td", { class: "event-reason" }, event.reason),
  );
}

function headings(labels) {
  return h("thead", null, h("tr", null, labels.map((label) => h("th", { scope: "col" }, label))));
}

// "2 serving (min 1, max 3)": what the summary and this tab say of the model's replicas.
export function replicaCount(model) {
  const serving = (model.replicas || []).filter((replica) => replica.status === "serving").length;
  const config = model.config || {};
  return `${serving} serving (min ${config.min_replicas ?? 1}, max ${config.max_replicas ?? 1})`;
}

// "3 requests in flight; 1.2 per replica over the last 30 s": the demand the scheduler adds and
// removes replicas by (GET /v1/models/{id}'s demand, as this control plane counts it).
export function replicaDemand(model) {
  const demand = model.demand;
  if (!demand) return "";
  const window = `${Math.round(demand.window_s)} s`;
  const perReplica = demand.per_replica === null
    ? `averaged over ${window} once the control plane has run that long`
    : `${demand.per_replica.toFixed(1)} per replica over the last ${window}`;
  return `${demand.in_flight} requests in flight; ${perReplica}`;
}

export async function replicasTab(container, context, model) {
  const { signal } = context;
  replace(container, loading("replicas"));
  const count = h("p", { class: "replica-count" });
  const demand = h("p", { class: "replica-demand muted" });
  const replicas = h("tbody");
  const events = h("tbody");
  const eventsTable = h("table", { class: "scale-events" },
    headings(["when", "event", "replicas", "worker", "reason"]), events);
  const noEvents = h("p", { class: "muted" },
    "No scale events yet: the scheduler records one each time it adds or removes a replica, ",
    "and when min_replicas or max_replicas change (skytrain models replicas).");

  async function draw(current) {
    const page = await get(`/v1/models/${encodeURIComponent(current.id)}/events`, { signal });
    replace(count, replicaCount(current));
    replace(demand, replicaDemand(current));
    replace(replicas, (current.replicas || []).map(replicaRow));
    replace(events, page.data.map(eventRow));
    eventsTable.hidden = page.data.length === 0;
    noEvents.hidden = page.data.length > 0;
  }
  await draw(model);
  replace(
    container,
    count,
    demand,
    h("table", { class: "replicas" }, headings(["worker", "role", "status", "in flight"]), replicas),
    h("h2", null, "Scale events"),
    noEvents,
    eventsTable,
  );
  return { refresh: draw };
}
