// Building the page. Text from the API only ever becomes text nodes or attribute values:
// nothing here parses HTML, so a trajectory that contains "<script>" shows those characters.

// h("a", {href: "#/", class: "x", onclick: fn, dataset: {k: v}}, "text", child, [more]) -> element
export function h(tag, attributes, ...children) {
  const element = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on") && typeof value === "function") {
      element.addEventListener(name.slice(2), value);
    } else if (name === "dataset") {
      Object.assign(element.dataset, value);
    } else if (name === "class") {
      element.className = value;
    } else if (name === "value" || name === "checked" || name === "open") {
      element[name] = value;
    } else {
      element.setAttribute(name, value === true ? "" : String(value));
    }
  }
  append(element, children);
  return element;
}

// "#/models/<id>/jobs?status=running": a page's address (see app.js for the routes).
export function link(parts, query) {
  const path = parts.map(encodeURIComponent).join("/");
  const entries = Object.entries(query || {}).filter(
    ([, value]) => value !== undefined && value !== null && value !== "",
  );
  const search = new URLSearchParams(entries).toString();
  return `#/${path}${search ? `?${search}` : ""}`;
}

export function append(element, children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    element.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return element;
}

export function replace(element, ...children) {
  element.replaceChildren();
  return append(element, children);
}

// Numbers as people read them: 4 significant digits, integers as they are.
export function formatNumber(value) {
  if (value === undefined || value === null || Number.isNaN(value)) return "–";
  if (Number.isInteger(value)) return value.toLocaleString("en-US");
  const magnitude = Math.abs(value);
  if (magnitude !== 0 && (magnitude < 1e-3 || magnitude >= 1e6)) return value.toExponential(3);
  return String(Number(value.toPrecision(4)));
}

export function formatTime(iso) {
  if (!iso) return "–";
  const date = new Date(iso);
  return date.toLocaleString("en-GB", { dateStyle: "medium", timeStyle: "medium" });
}

// "12 s ago", "3 min ago", "5 h ago", "2 days ago"
export function formatAgo(iso, now = Date.now()) {
  if (!iso) return "–";
  const seconds = Math.max(0, (now - new Date(iso).getTime()) / 1000);
  if (seconds < 60) return `${Math.round(seconds)} s ago`;
  if (seconds < 3600) return `${Math.round(seconds / 60)} min ago`;
  if (seconds < 86400) return `${Math.round(seconds / 3600)} h ago`;
  return `${Math.round(seconds / 86400)} days ago`;
}

export function formatDuration(startIso, endIso) {
  if (!startIso) return "–";
  const end = endIso ? new Date(endIso).getTime() : Date.now();
  const seconds = Math.max(0, (end - new Date(startIso).getTime()) / 1000);
  if (seconds < 120) return `${seconds.toFixed(1)} s`;
  return `${(seconds / 60).toFixed(1)} min`;
}

// A status word as a coloured badge; the word itself is the text (colour is never alone).
export function badge(status, title) {
  return h("span", { class: `badge badge-${status}`, title, dataset: { status } }, status);
}

export function loading(what) {
  return h("p", { class: "muted", role: "status" }, `Loading ${what}…`);
}

export function errorBox(error) {
  return h("div", { class: "error", role: "alert" }, error.message || String(error));
}

export function shortId(id) {
  return id.length > 10 ? id.slice(0, 8) : id;
}

// A read-only text with a button that copies it (the text stays selectable when the
// clipboard is not available).
export function copyable(text, label) {
  const field = h("input", {
    class: "copy-field",
    type: "text",
    readonly: true,
    value: text,
    "aria-label": label,
    size: Math.min(Math.max(text.length, 10), 40),
    onfocus: (event) => event.target.select(),
  });
  const button = h("button", { type: "button", class: "quiet" }, "Copy");
  button.addEventListener("click", async () => {
    try {
      await navigator.clipboard.writeText(text);
      button.textContent = "Copied";
    } catch {
      field.focus();
      button.textContent = "Press Ctrl+C";
    }
    setTimeout(() => {
      button.textContent = "Copy";
    }, 1500);
  });
  return h("span", { class: "copyable" }, field, button);
}
