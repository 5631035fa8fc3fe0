// The tenants panel: built from whatever loraserve_tenant_* series /metrics carries (one row
// per tenant, one column per series; limits by their `limit` label), hidden when none.
const PREFIX = "loraserve_tenant_";

function columnsOf(metrics) {
  const columns = []; // {title, name, where}
  for (const name of metrics.names(PREFIX).sort()) {
    if (name.endsWith("_created")) continue; // the client library's creation timestamps
    const short = name.slice(PREFIX.length).replace(/_total$/, "").replace(/_/g, " ");
    if (name === `${PREFIX}limit`) {
      const kinds = new Set(metrics.byName.get(name).map((s) => s.labels.limit).filter(Boolean));
      for (const kind of [...kinds].sort()) {
        columns.push({ title: `limit: ${kind.replace(/_/g, " ")}`, name,
          where: (labels) => labels.limit === kind });
      }
    } else {
      columns.push({ title: short, name, where: () => true });
    }
  }
  return columns;
}

function fmt(v) {
  if (v == null) return "—";
  if (!Number.isFinite(v)) return v > 0 ? "∞" : "—";
  return Number.isInteger(v) ? `${v}` : v.toFixed(2);
}

export function renderTenants(section, metrics) {
  const tenants = new Set();
  if (metrics) {
    for (const name of metrics.names(PREFIX)) {
      for (const s of metrics.byName.get(name)) if (s.labels.tenant) tenants.add(s.labels.tenant);
    }
  }
  section.hidden = tenants.size === 0;
  if (section.hidden) return;
  const columns = columnsOf(metrics);
  const table = section.querySelector("table");
  const head = document.createElement("tr");
  const corner = document.createElement("th");
  corner.scope = "col";
  corner.textContent = "tenant";
  head.append(corner, ...columns.map((c) => {
    const th = document.createElement("th");
    th.scope = "col";
    th.textContent = c.title;
    return th;
  }));
  table.tHead.replaceChildren(head);
  const rows = [...tenants].sort().map((tenant) => {
    const tr = document.createElement("tr");
    const th = document.createElement("th");
    th.scope = "row";
    th.textContent = tenant;
    tr.append(th, ...columns.map((c) => {
      const td = document.createElement("td");
      td.textContent = fmt(metrics.sum(c.name, (l) => l.tenant === tenant && c.where(l)));
      return td;
    }));
    return tr;
  });
  table.tBodies[0].replaceChildren(...rows);
}
