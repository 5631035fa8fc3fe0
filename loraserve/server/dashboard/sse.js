// One streamed completion: fetch + ReadableStream over the server-sent events of
// /v1/completions or /v1/chat/completions (EventSource cannot POST or send a key).
import { authHeaders, errorMessage } from "./api.js";

// Calls onChunk(parsedEvent) for each `data:` event until [DONE]; throws on an HTTP error or
// an error event (the server ends a failed stream with one).
export async function streamEvents(path, body, onChunk, signal) {
  const res = await fetch(path, {
    method: "POST", signal, cache: "no-store",
    headers: authHeaders({ "Content-Type": "application/json", Accept: "text/event-stream" }),
    body: JSON.stringify({ ...body, stream: true }),
  });
  if (!res.ok) throw new Error(errorMessage(res.status, await res.text()));
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) !== -1) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        const parsed = JSON.parse(data);
        if (parsed.error) throw new Error(parsed.error.message || "stream error");
        onChunk(parsed);
      }
    }
  }
}
