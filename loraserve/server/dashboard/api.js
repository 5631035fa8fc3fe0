// The server's routes, called with the key the operator typed (kept in this tab only).
const KEY = "loraserve.apiKey";

export function getKey() {
  return sessionStorage.getItem(KEY) || "";
}

export function setKey(key) {
  if (key) sessionStorage.setItem(KEY, key);
  else sessionStorage.removeItem(KEY);
}

export function authHeaders(extra = {}) {
  const key = getKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : { ...extra };
}

// The OpenAI-shaped error's message, or the status line when the body is something else.
export function errorMessage(status, text) {
  try {
    const body = JSON.parse(text);
    if (body && body.error && body.error.message) return `${status}: ${body.error.message}`;
  } catch (_) { /* not JSON */ }
  return `${status}: ${text.slice(0, 200) || "no answer"}`;
}

// {ok, status, body (parsed JSON or text), error (a message when not ok)}
export async function request(path, { method = "GET", json, signal } = {}) {
  const init = { method, headers: authHeaders(json ? { "Content-Type": "application/json" } : {}),
                 signal, cache: "no-store" };
  if (json !== undefined) init.body = JSON.stringify(json);
  let res;
  try {
    res = await fetch(path, init);
  } catch (e) {
    return { ok: false, status: 0, body: null, error: `server unreachable (${e.message})` };
  }
  const text = await res.text();
  let body = text;
  if ((res.headers.get("content-type") || "").includes("json")) {
    try { body = JSON.parse(text); } catch (_) { /* keep the text */ }
  }
  return { ok: res.ok, status: res.status, body, error: res.ok ? null : errorMessage(res.status, text) };
}
