// The page's wiring: the key, what it may do, the poller and the panels it feeds.
import { getKey, request, setKey } from "./api.js";
import { LoadForm, ModelTable } from "./adapters.js";
import { LiveView } from "./live.js";
import { Playground } from "./playground.js";
import { renderTenants } from "./tenants.js";

const $ = (id) => document.getElementById(id);

const table = new ModelTable({ table: $("models"), status: $("action-status"), form: null });
const loadForm = new LoadForm($("load-form"), table);
const playground = new Playground({ form: $("playground"), models: $("play-models"),
                                    outputs: $("outputs"), diff: $("diff") });

const live = new LiveView({
  charts: $("charts"),
  note: $("metrics-note"),
  onData({ models, metrics }) {
    const banner = $("models-error");
    if (!models.ok) {
      banner.hidden = false;
      banner.textContent = models.status === 401
        ? "This server needs an API key: enter yours above."
        : `Cannot list models: ${models.error}`;
      table.render([], null);
      renderTenants($("tenants"), null);
      return;
    }
    banner.hidden = true;
    const cards = models.body.data || [];
    const base = cards.find((c) => c.parent == null);
    $("model-name").textContent = base ? base.id : "";
    table.render(cards, metrics);
    renderTenants($("tenants"), metrics);
    playground.setModels(cards);
  },
});
table.onChange = () => live.refresh();

async function refreshAccess() {
  const r = await request("/dashboard/access");
  const access = r.ok ? r.body : { operator: false, adapter_updates: false };
  const badge = $("access");
  badge.textContent = !r.ok ? (r.status === 401 ? "key needed" : "no access")
    : access.adapter_updates ? "admin" : access.operator ? "operator (read-only)" : "client";
  badge.className = `badge ${access.adapter_updates ? "admin" : ""}`;
  table.form = access.adapter_updates ? loadForm : null;
  table.setAccess(access);
  $("load-form").hidden = !access.adapter_updates;
  document.body.classList.toggle("admin", access.adapter_updates);
}

async function start() {
  await refreshAccess();
  await live.refresh();
}

$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  setKey($("api-key").value.trim());
  $("api-key").value = "";
  $("api-key").placeholder = getKey() ? "key in use (this tab only)" : "admin or client key";
  start();
});
$("forget-key").addEventListener("click", () => {
  setKey("");
  $("api-key").placeholder = "admin or client key";
  start();
});
if (getKey()) $("api-key").placeholder = "key in use (this tab only)";
start();
