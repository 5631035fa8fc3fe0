// The live view: /metrics and /v1/models polled while the page is open (never while the tab
// is hidden), rates and latencies worked out from the counters, kept in a ring buffer.
import { request } from "./api.js";
import { LineChart, Ring } from "./charts.js";
import { parsePrometheus } from "./prom.js";

export const POLL_MS = 2000;
const WINDOW_S = 300;

const pct = (v) => `${(v * 100).toFixed(v < 0.1 && v > 0 ? 1 : 0)}%`;
const count = (v) => `${Math.round(v)}`;
const rate = (v) => `${v < 10 ? v.toFixed(1) : Math.round(v)}/s`;
const secs = (v) => (v < 1 ? `${(v * 1000).toFixed(v < 0.01 ? 1 : 0)} ms` : `${v.toFixed(2)} s`);

// a counter's increase per second since the previous scrape (null: none, or it was reset)
function perSecond(cur, prev, dt) {
  if (cur == null || prev == null || dt <= 0 || cur < prev) return null;
  return (cur - prev) / dt;
}

// mean latency of what finished between two scrapes, from a histogram's _sum and _count
function meanSince(cur, prev, family) {
  if (!prev) return null;
  const dn = cur[`${family}_count`] - prev[`${family}_count`];
  const ds = cur[`${family}_sum`] - prev[`${family}_sum`];
  return dn > 0 && ds >= 0 ? ds / dn : null;
}

const COUNTERS = ["loraserve_generation_tokens_total", "loraserve_prompt_tokens_total",
  "loraserve_time_to_first_token_seconds_sum", "loraserve_time_to_first_token_seconds_count",
  "loraserve_inter_token_latency_seconds_sum", "loraserve_inter_token_latency_seconds_count"];

export class LiveView {
  constructor({ charts, note, onData }) {
    this.note = note;
    this.onData = onData;
    this.points = new Ring(Math.ceil((WINDOW_S * 1000) / POLL_MS) + 1);
    this.prev = null;
    this.timer = null;
    this.busy = false;
    this.again = false; // a refresh asked for while a scrape was on its way
    const opts = { windowS: WINDOW_S };
    this.charts = [
      new LineChart(charts, { ...opts, title: "KV cache in use", format: pct, fixedMax: 1,
        series: [{ key: "kv", label: "used", cls: "s1" }] }),
      new LineChart(charts, { ...opts, title: "Requests", format: count,
        series: [{ key: "running", label: "running", cls: "s1" },
                 { key: "waiting", label: "waiting", cls: "s2" }] }),
      new LineChart(charts, { ...opts, title: "Throughput (tokens)", format: rate,
        series: [{ key: "gen", label: "out", cls: "s1" },
                 { key: "prompt", label: "in", cls: "s2" }] }),
      new LineChart(charts, { ...opts, title: "Time to first token (mean)", format: secs,
        series: [{ key: "ttft", label: "TTFT", cls: "s1" }] }),
      new LineChart(charts, { ...opts, title: "Time per output token (mean)", format: secs,
        series: [{ key: "tpot", label: "TPOT", cls: "s1" }] }),
    ];
    document.addEventListener("visibilitychange", () => {
      if (document.hidden) this.stop();
      else this.refresh();
    });
  }

  stop() {
    clearTimeout(this.timer);
    this.timer = null;
  }

  // poll now, then every POLL_MS while the tab is visible
  refresh() {
    this.stop();
    return this.tick();
  }

  async tick() {
    if (this.busy) { this.again = true; return; } // one scrape at a time: rates need a gap
    this.busy = true;
    let metrics, models;
    try {
      [metrics, models] = await Promise.all([request("/metrics"), request("/v1/models")]);
    } finally {
      this.busy = false;
    }
    let parsed = null;
    if (metrics.ok) {
      parsed = parsePrometheus(metrics.body);
      this.record(parsed);
      this.note.hidden = true;
    } else {
      this.prev = null;
      this.note.hidden = false;
      this.note.textContent = metrics.status === 401 || metrics.status === 403
        ? "Metrics need the admin key: enter it above to see the charts."
        : `Metrics unavailable (${metrics.error}).`;
    }
    this.onData({ models, metrics: parsed });
    clearTimeout(this.timer);
    this.timer = null;
    if (document.hidden) return;
    if (this.again) { this.again = false; this.timer = setTimeout(() => this.tick(), 0); }
    else this.timer = setTimeout(() => this.tick(), POLL_MS);
  }

  record(m) {
    const t = performance.now() / 1000;
    const cur = { t };
    for (const name of COUNTERS) cur[name] = m.sum(name);
    const prev = this.prev;
    const dt = prev ? t - prev.t : 0;
    const used = m.sum("loraserve_kv_cache_blocks_used");
    const total = m.sum("loraserve_kv_cache_blocks_total");
    this.points.push({
      t,
      kv: total ? used / total : null,
      running: m.sum("loraserve_num_requests_running"),
      waiting: m.sum("loraserve_num_requests_waiting"),
      gen: prev ? perSecond(cur.loraserve_generation_tokens_total,
        prev.loraserve_generation_tokens_total, dt) : null,
      prompt: prev ? perSecond(cur.loraserve_prompt_tokens_total,
        prev.loraserve_prompt_tokens_total, dt) : null,
      ttft: meanSince(cur, prev, "loraserve_time_to_first_token_seconds"),
      tpot: meanSince(cur, prev, "loraserve_inter_token_latency_seconds"),
    });
    this.prev = cur;
    for (const chart of this.charts) chart.update(this.points.items);
  }
}
