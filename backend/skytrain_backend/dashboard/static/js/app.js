// The dashboard: sign-in, routing between pages (in the URL's fragment, so every page has a
// link), and the life of a page (its requests and polling stop when another page is shown).
//
// Routes:  #/                              models (?project= filters)
//          #/models/<id>                   a model: metrics per step
//          #/models/<id>/trajectories      logged groups of a step (?split=&step=&batch=)
//          #/models/<id>/checkpoints       steps, inference names, downloads
//          #/models/<id>/jobs              training jobs
//          #/jobs/<id>                     a job and its events as they arrive
//          #/compare?project=<p>           the models of a project on the same charts
// A link with ?key=sk-st-... (or #key=...) signs in with that key and drops it from the URL.

import { ApiError, apiKey, clearApiKey, get, setApiKey } from "./api.js";
import { errorBox, h, link, replace } from "./dom.js";
import { comparePage } from "./pages/compare.js";
import { jobPage } from "./pages/job.js";
import { modelPage } from "./pages/model.js";
import { modelsPage } from "./pages/models.js";

const main = document.getElementById("main");
const crumbs = document.getElementById("crumbs");
const signOutButton = document.getElementById("sign-out");
let shown = null; // the AbortController of the page on screen

function parseLocation() {
  let raw = window.location.hash.replace(/^#\/?/, "");
  if (raw.startsWith("key=")) raw = `?${raw}`;
  const mark = raw.indexOf("?");
  const path = mark === -1 ? raw : raw.slice(0, mark);
  return {
    parts: path.split("/").filter(Boolean).map(decodeURIComponent),
    query: new URLSearchParams(mark === -1 ? "" : raw.slice(mark + 1)),
  };
}

// Take a key from a sign-in link, and rewrite the URL without it (history keeps no key).
function takeKeyFromLink() {
  const { parts, query } = parseLocation();
  const key = query.get("key");
  if (!key) return;
  setApiKey(key);
  query.delete("key");
  window.history.replaceState(null, "", link(parts, Object.fromEntries(query)));
}

function setCrumbs(items) {
  replace(crumbs, items.map((item, index) => [
    index ? h("span", { class: "crumb-sep", "aria-hidden": "true" }, "/") : null,
    item.href ? h("a", { href: item.href }, item.label) : h("span", { "aria-current": "page" }, item.label),
  ]));
}

function signInPage(message) {
  shown?.abort();
  setCrumbs([{ label: "Sign in" }]);
  signOutButton.hidden = true;
  const input = h("input", {
    id: "api-key", name: "api-key", type: "password", autocomplete: "off", required: true,
    placeholder: "sk-st-...", spellcheck: "false",
  });
  const status = h("div", { class: "form-status", role: "alert" }, message || "");
  const form = h(
    "form",
    { class: "card sign-in", novalidate: true },
    h("h1", null, "Sign in"),
    h("p", null, "Paste an API key of your tenant. It stays in this browser (local storage) ",
      "and is sent only to this server, as every client sends it."),
    h("label", { for: "api-key" }, "API key"),
    input,
    h("button", { type: "submit" }, "Sign in"),
    status,
    h("p", { class: "muted small" }, "No key? An operator creates one with ",
      h("code", null, "skytrain keys create --tenant NAME"), "."),
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const key = input.value.trim();
    if (!key) {
      status.textContent = "Enter an API key (it starts with sk-st-).";
      return;
    }
    status.textContent = "";
    setApiKey(key);
    try {
      await get("/v1/models", { params: { limit: 1 } });
    } catch (error) {
      clearApiKey();
      status.textContent = error.message;
      return;
    }
    render();
  });
  replace(main, form);
  input.focus();
}

function every(signal, milliseconds, task, onError) {
  let timer = null;
  const tick = async () => {
    if (signal.aborted) return;
    if (!document.hidden) {
      try {
        await task();
      } catch (error) {
        if (signal.aborted || error.name === "AbortError") return;
        onError(error);
      }
    }
    if (!signal.aborted) timer = setTimeout(tick, milliseconds);
  };
  timer = setTimeout(tick, milliseconds);
  signal.addEventListener("abort", () => clearTimeout(timer));
}

function route(parts) {
  if (parts.length === 0) return modelsPage;
  if (parts[0] === "models" && parts.length >= 2 && parts.length <= 3) return modelPage;
  if (parts[0] === "jobs" && parts.length === 2) return jobPage;
  if (parts[0] === "compare" && parts.length === 1) return comparePage;
  return null;
}

async function render() {
  shown?.abort();
  takeKeyFromLink();
  if (!apiKey()) {
    signInPage();
    return;
  }
  signOutButton.hidden = false;
  const controller = new AbortController();
  shown = controller;
  const { parts, query } = parseLocation();
  const page = route(parts);
  const banner = h("div", { class: "poll-error", role: "status" });
  const context = {
    parts,
    query,
    signal: controller.signal,
    setCrumbs,
    // Run ``task`` every ``milliseconds`` while the page is shown; a failure is shown in a
    // banner and the next run tries again.
    every: (milliseconds, task) =>
      every(controller.signal, milliseconds, async () => {
        await task();
        banner.textContent = "";
      }, (error) => {
        if (error instanceof ApiError && error.status === 401) {
          clearApiKey();
          signInPage(error.message);
          return;
        }
        banner.textContent = `Could not refresh: ${error.message}`;
      }),
  };
  const root = h("div", { class: "page" });
  replace(main, banner, root);
  if (page === null) {
    setCrumbs([{ label: "Not found" }]);
    root.append(errorBox(new Error(`No page at ${window.location.hash}: go back to the models.`)));
    return;
  }
  try {
    await page(root, context);
  } catch (error) {
    if (controller.signal.aborted || error.name === "AbortError") return;
    if (error instanceof ApiError && error.status === 401) {
      clearApiKey();
      signInPage(error.message);
      return;
    }
    root.append(errorBox(error));
  }
}

signOutButton.addEventListener("click", () => {
  clearApiKey();
  window.location.hash = "#/";
  render();
});
window.addEventListener("hashchange", render);
render();
