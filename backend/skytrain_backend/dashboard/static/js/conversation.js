// Logged trajectories as conversations: messages, sampled turns (tokens shaded by their
// logprob), tool calls and tool results. Everything from the trajectory becomes text.

import { formatNumber, h } from "./dom.js";

const ROLES = new Set(["system", "developer", "user", "assistant", "tool"]);

function isChoice(item) {
  return item !== null && typeof item === "object" && "message" in item && !("role" in item);
}

function contentText(content) {
  if (content === null || content === undefined) return "";
  if (typeof content === "string") return content;
  if (Array.isArray(content)) {
    return content
      .map((part) => (part && part.type === "text" ? part.text : JSON.stringify(part)))
      .join("\n");
  }
  return JSON.stringify(content);
}

function prettyJson(text) {
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch {
    return String(text);
  }
}

// The sampled tokens with their logprobs, and their text when the tokens carry it: sampled
// through skytrain, a token reads "token_id:<id>" (vLLM's return_tokens_as_token_ids) and its
// bytes are those of that label, so the text is the message's, shown above the tokens.
function sampledTokens(logprobs) {
  const entries = logprobs && Array.isArray(logprobs.content) ? logprobs.content : [];
  if (!entries.length) return null;
  const decoder = new TextDecoder("utf-8");
  const tokens = entries.map((entry) => ({
    token: String(entry.token),
    logprob: Number(entry.logprob),
    // decoded as a stream, so a character split over two tokens shows whole
    text: Array.isArray(entry.bytes) ? decoder.decode(new Uint8Array(entry.bytes), { stream: true }) : null,
  }));
  const asIds = tokens.some((token) => token.text === null || token.token.startsWith("token_id:"));
  return { tokens, asIds };
}

function shadedTokens({ tokens, asIds }) {
  return h(
    "div",
    { class: asIds ? "tokens token-ids" : "content tokens", "aria-label": "sampled tokens shaded by logprob" },
    tokens.map(({ text, token, logprob }) => {
      const probability = Math.exp(logprob);
      const span = h("span", {
        class: "token",
        title: `${token} · logprob ${logprob.toFixed(3)} · p ${probability.toFixed(3)}`,
        dataset: { logprob: String(logprob) },
      }, asIds ? token.replace(/^token_id:/, "") : text);
      // Unlikely tokens (low probability) are shaded darker.
      span.style.backgroundColor = `rgba(234, 88, 12, ${(0.6 * (1 - probability)).toFixed(3)})`;
      return span;
    }),
  );
}

function toolCalls(calls) {
  if (!Array.isArray(calls) || !calls.length) return null;
  return h(
    "div",
    { class: "tool-calls" },
    calls.map((call) => {
      const fn = (call && call.function) || {};
      return h(
        "div",
        { class: "tool-call", dataset: { tool: String(fn.name || "") } },
        h("div", { class: "tool-call-head" }, "tool call ", h("code", null, String(fn.name || "?")),
          call.id ? h("span", { class: "muted" }, ` · ${call.id}`) : null),
        h("pre", { class: "tool-arguments" }, prettyJson(fn.arguments ?? "{}")),
      );
    }),
  );
}

function messageView(message, { choice = null, shade = false } = {}) {
  const role = ROLES.has(message.role) ? message.role : "other";
  const details = [];
  if (message.name) details.push(`name ${message.name}`);
  if (role === "tool" && message.tool_call_id) details.push(`result of ${message.tool_call_id}`);
  if (choice) {
    details.push("sampled");
    if (choice.finish_reason) details.push(`finish: ${choice.finish_reason}`);
  }
  const sampled = choice && shade ? sampledTokens(choice.logprobs) : null;
  const text = contentText(message.content);
  const body = [];
  if (text && !(sampled && !sampled.asIds)) body.push(h("div", { class: "content" }, text));
  if (sampled) body.push(shadedTokens(sampled));
  return h(
    "div",
    { class: `message message-${role}${choice ? " sampled" : ""}`, dataset: { role } },
    h("div", { class: "message-role" }, String(message.role ?? "?"),
      details.length ? h("span", { class: "muted" }, ` · ${details.join(" · ")}`) : null),
    body,
    toolCalls(message.tool_calls),
  );
}

export function conversation(items, { shade }) {
  return h(
    "div",
    { class: "conversation" },
    (items || []).map((item) =>
      isChoice(item)
        ? messageView(item.message || {}, { choice: item, shade })
        : messageView(item || {}, { shade })),
  );
}

export function keyValues(title, object) {
  const entries = Object.entries(object || {});
  if (!entries.length) return null;
  return h(
    "div",
    { class: "key-values" },
    h("h5", null, title),
    h("dl", null, entries.map(([key, value]) => [
      h("dt", null, key),
      h("dd", null, typeof value === "number" ? formatNumber(value) : JSON.stringify(value)),
    ])),
  );
}

function toolsOffered(tools) {
  if (!Array.isArray(tools) || !tools.length) return null;
  const names = tools.map((tool) => (tool && tool.function && tool.function.name) || "?");
  return h("details", { class: "tools" }, h("summary", null, `tools offered: ${names.join(", ")}`),
    h("pre", null, JSON.stringify(tools, null, 2)));
}

// The inside of a trajectory: conversation, tools, metrics, metadata, logs, other histories.
export function trajectoryBody(trajectory, { shade }) {
  const histories = (trajectory.additional_histories || []).map((history, index) =>
    h("details", { class: "history" }, h("summary", null, `additional history ${index + 1}`),
      toolsOffered(history.tools), conversation(history.messages_and_choices, { shade })));
  return h(
    "div",
    { class: "trajectory-body" },
    toolsOffered(trajectory.tools),
    conversation(trajectory.messages_and_choices, { shade }),
    histories,
    h("div", { class: "key-value-row" },
      keyValues("metrics", trajectory.metrics), keyValues("metadata", trajectory.metadata)),
    trajectory.logs && trajectory.logs.length
      ? h("details", { class: "logs" }, h("summary", null, `logs (${trajectory.logs.length})`),
        h("pre", null, trajectory.logs.join("\n")))
      : null,
  );
}
