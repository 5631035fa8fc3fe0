// The model table (the base model and every adapter version) and the admin actions on it.
import { request } from "./api.js";

const COLUMNS = ["model", "version", "tier", "pinned", "running", "waiting", "tokens",
  "prefix", "load", "replicas", "actions", "path"];
const PATH_CHARS = 32; // longer paths show their end; the whole one is the cell's tooltip

function shortPath(path) {
  return path.length <= PATH_CHARS ? path : `…${path.slice(path.length - PATH_CHARS + 1)}`;
}

function fmtSeconds(v) {
  if (v == null) return "—";
  return v < 1 ? `${Math.round(v * 1000)} ms` : `${v.toFixed(2)} s`;
}

function versionText(card) {
  if (card.parent == null) return "base";
  const live = card.versions && card.versions.length > 1 ? ` (live: ${card.versions.join(", ")})` : "";
  return `v${card.version}${live}`;
}

function button(text, label, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = text;
  b.setAttribute("aria-label", label);
  b.addEventListener("click", onClick);
  return b;
}

// Per-model figures from /metrics (null when the key may not read it).
function figures(card, metrics, isBase) {
  if (!metrics) return { tokens: null, prefix: null, load: null };
  const tokens = metrics.sumBy("loraserve_adapter_generation_tokens_total", "adapter");
  let served = tokens.get(card.id) ?? 0;
  if (isBase) {
    let adapters = 0;
    for (const v of tokens.values()) adapters += v;
    served = Math.max(0, (metrics.sum("loraserve_generation_tokens_total") ?? 0) - adapters);
  }
  const queries = metrics.sumBy("loraserve_prefix_cache_queries_total", "adapter").get(card.id);
  const hits = metrics.sumBy("loraserve_prefix_cache_hits_total", "adapter").get(card.id);
  let load = null;
  for (const s of metrics.byName.get("loraserve_adapter_last_load_seconds") || []) {
    if (s.labels.adapter === card.id) load = Math.max(load ?? 0, s.value);
  }
  return { tokens: served, prefix: queries ? hits / queries : null, load };
}

export class ModelTable {
  constructor({ table, status, form }) {
    this.table = table;
    this.body = table.querySelector("tbody");
    this.status = status;
    this.form = form; // the admin load form (LoadForm), or null
    this.rows = new Map(); // model id -> {tr, cells, actionsKey}
    this.access = { operator: false, adapter_updates: false };
    this.onChange = () => {};
  }

  setAccess(access) {
    this.access = access;
    this.table.classList.toggle("show-path", access.operator);
    this.table.classList.toggle("show-actions", access.adapter_updates);
    for (const row of this.rows.values()) row.actionsKey = null; // rebuild the buttons
  }

  say(text, isError = false) {
    this.status.textContent = text;
    this.status.classList.toggle("error", isError);
  }

  async act(what, path, json) {
    this.say(`${what}…`);
    const r = await request(path, { method: "POST", json });
    this.say(r.ok ? (r.body.message || `${what}: done`) : `${what} failed: ${r.error}`, !r.ok);
    this.onChange();
    return r.ok;
  }

  render(cards, metrics) {
    const cluster = cards.some((c) => Array.isArray(c.replicas));
    this.table.classList.toggle("show-replicas", cluster);
    const seen = new Set();
    let before = this.body.firstChild;
    for (const card of cards) {
      seen.add(card.id);
      let row = this.rows.get(card.id);
      if (!row) {
        row = this.newRow(card.id);
        this.rows.set(card.id, row);
      }
      if (row.tr !== before) this.body.insertBefore(row.tr, before);
      before = row.tr.nextSibling;
      this.fill(row, card, metrics);
    }
    for (const [id, row] of this.rows) {
      if (!seen.has(id)) { row.tr.remove(); this.rows.delete(id); }
    }
  }

  newRow(id) {
    const tr = document.createElement("tr");
    tr.dataset.model = id;
    const cells = {};
    for (const col of COLUMNS) {
      const cell = document.createElement(col === "model" ? "th" : "td");
      if (col === "model") cell.scope = "row";
      cell.className = `col-${col}`;
      cells[col] = cell;
      tr.append(cell);
    }
    return { tr, cells, actionsKey: null };
  }

  fill(row, card, metrics) {
    const isBase = card.parent == null;
    const c = row.cells;
    const inFlight = card.in_flight ?? 0, waiting = card.waiting ?? 0;
    const f = figures(card, metrics, isBase);
    c.model.textContent = card.id;
    c.version.textContent = versionText(card);
    c.tier.replaceChildren(Object.assign(document.createElement("span"),
      { className: `tier tier-${card.tier}`, textContent: card.tier }));
    c.pinned.textContent = card.pinned ? "pinned" : "—";
    c.running.textContent = `${Math.max(0, inFlight - waiting)}`;
    c.waiting.textContent = `${waiting}`;
    c.tokens.textContent = f.tokens == null ? "—" : `${f.tokens}`;
    c.prefix.textContent = f.prefix == null ? "—" : `${Math.round(f.prefix * 100)}%`;
    c.load.textContent = isBase ? "" : fmtSeconds(f.load);
    c.replicas.textContent = (card.replicas || [])
      .map((r) => `${r.replica}: ${r.tier}`).join(" · ");
    const path = this.access.operator && card.root !== card.id ? card.root : "";
    c.path.textContent = shortPath(path);
    c.path.title = path;
    const key = JSON.stringify([this.access.adapter_updates, card.pinned, card.root, isBase]);
    if (row.actionsKey !== key) {
      row.actionsKey = key;
      c.actions.replaceChildren(...(this.access.adapter_updates && !isBase
        ? this.actions(card) : []));
    }
  }

  actions(card) {
    const out = [button("Unload", `Unload ${card.id}`, () =>
      this.act(`Unloading ${card.id}`, "/v1/unload_lora_adapter", { lora_name: card.id }))];
    const newest = Array.isArray(card.versions);
    if (newest && !card.pinned && this.access.operator && card.root !== card.id) {
      out.push(button("Pin", `Pin ${card.id}`, () =>
        this.act(`Pinning ${card.id}`, "/v1/load_lora_adapter",
          { lora_name: card.id, lora_path: card.root, pinned: true })));
    }
    if (newest && this.form) {
      out.push(button("Replace…", `Replace ${card.id} with new weights`,
        () => this.form.prefill(card.id)));
    }
    return out;
  }
}

// The admin form: load an adapter from a path on the server (optionally as a new version).
export class LoadForm {
  constructor(form, table) {
    this.form = form;
    this.table = table;
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      const data = new FormData(form);
      const name = String(data.get("name")).trim(), path = String(data.get("path")).trim();
      const replace = data.get("replace") === "on";
      table.act(`${replace ? "Replacing" : "Loading"} ${name}`, "/v1/load_lora_adapter",
        { lora_name: name, lora_path: path, pinned: data.get("pinned") === "on", replace })
        .then((ok) => { if (ok) form.reset(); });
    });
  }

  prefill(name) {
    this.form.elements.name.value = name;
    this.form.elements.replace.checked = true;
    this.form.elements.path.focus();
  }
}
