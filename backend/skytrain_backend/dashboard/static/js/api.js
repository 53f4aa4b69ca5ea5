// The REST API, called with the signed-in user's key; pages of lists followed by cursor.

const KEY_STORAGE = "skytrain.apiKey";
export const PAGE_LIMIT = 100; // the API's largest page

export class ApiError extends Error {
  constructor(status, type, message) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.type = type;
  }
}

export function apiKey() {
  return localStorage.getItem(KEY_STORAGE);
}

export function setApiKey(key) {
  localStorage.setItem(KEY_STORAGE, key);
}

export function clearApiKey() {
  localStorage.removeItem(KEY_STORAGE);
}

function url(path, params) {
  const target = new URL(path, window.location.origin);
  for (const [name, value] of Object.entries(params || {})) {
    if (value !== undefined && value !== null && value !== "") {
      target.searchParams.set(name, String(value));
    }
  }
  return target;
}

// The response of a GET, or an ApiError carrying the server's message.
export async function request(path, { params, signal, accept = "application/json" } = {}) {
  const response = await fetch(url(path, params), {
    headers: { Authorization: `Bearer ${apiKey() || ""}`, Accept: accept },
    signal,
  });
  if (!response.ok) {
    let body = null;
    try {
      body = await response.json();
    } catch {
      // not a JSON error body (a proxy's page): the status says enough
    }
    const error = body && body.error;
    throw new ApiError(
      response.status,
      (error && error.type) || "http_error",
      (error && error.message) || `the server answered ${response.status} ${response.statusText}`,
    );
  }
  return response;
}

export async function get(path, options) {
  return (await request(path, options)).json();
}

// Every item of a paged list, following ``after`` until ``has_more`` is false.
export async function getAll(path, { params, signal, cursor = (item) => item.id } = {}) {
  const items = [];
  let after = params && params.after;
  for (;;) {
    const page = await get(path, { params: { ...params, limit: PAGE_LIMIT, after }, signal });
    items.push(...page.data);
    if (!page.has_more || page.data.length === 0) return items;
    after = cursor(page.data[page.data.length - 1]);
  }
}

// Runs ``task`` on every item, at most ``concurrency`` at a time; results in item order.
export async function mapLimited(items, concurrency, task) {
  const results = new Array(items.length);
  let next = 0;
  async function worker() {
    while (next < items.length) {
      const index = next++;
      results[index] = await task(items[index], index);
    }
  }
  await Promise.all(Array.from({ length: Math.min(concurrency, items.length) }, worker));
  return results;
}
