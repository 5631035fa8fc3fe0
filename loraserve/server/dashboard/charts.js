// Small live line charts in plain SVG, over a fixed-size ring buffer of recent points.

const SVG = "http://www.w3.org/2000/svg";

export class Ring {
  constructor(capacity) {
    this.capacity = capacity;
    this.items = [];
  }

  push(item) {
    this.items.push(item);
    if (this.items.length > this.capacity) this.items.shift();
  }

  get length() {
    return this.items.length;
  }

  last() {
    return this.items[this.items.length - 1];
  }
}

function el(name, attrs = {}) {
  const node = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}

// A chart card: <figure> with a title, the current values and an SVG; update() redraws it.
export class LineChart {
  // series: [{key, label, cls}]; format(v) -> text; fixedMax: a y range that never grows
  constructor(parent, { title, series, format, fixedMax = null, windowS }) {
    this.series = series;
    this.format = format;
    this.fixedMax = fixedMax;
    this.windowS = windowS;
    this.figure = document.createElement("figure");
    this.figure.className = "chart";
    const caption = document.createElement("figcaption");
    const name = document.createElement("span");
    name.className = "chart-title";
    name.textContent = title;
    this.readout = document.createElement("span");
    this.readout.className = "chart-now";
    caption.append(name, this.readout);
    this.svg = el("svg", { viewBox: "0 0 300 90", preserveAspectRatio: "none", role: "img",
                           "aria-label": title });
    // the scale is HTML, not SVG text: the SVG stretches to the card's width
    this.scale = document.createElement("span");
    this.scale.className = "chart-scale";
    this.figure.append(caption, this.svg, this.scale);
    parent.append(this.figure);
  }

  // points: [{t (seconds), [key]: number | null}]
  update(points) {
    const now = points.length ? points[points.length - 1].t : 0;
    let max = this.fixedMax || 0;
    for (const p of points) {
      for (const s of this.series) if (p[s.key] != null && p[s.key] > max) max = p[s.key];
    }
    if (!max) max = 1;
    const x = (t) => 300 - ((now - t) / this.windowS) * 300;
    const y = (v) => 84 - (v / max) * 78;
    this.svg.replaceChildren(
      el("line", { x1: 0, x2: 300, y1: 6, y2: 6, class: "grid" }),
      el("line", { x1: 0, x2: 300, y1: 84, y2: 84, class: "axis" }),
    );
    this.scale.textContent = `top: ${this.format(max)} · ${Math.round(this.windowS / 60)} min`;
    for (const s of this.series) {
      // a gap (null) breaks the line: no sample is not zero
      let d = "", pen = "M";
      for (const p of points) {
        const v = p[s.key];
        if (v == null || !Number.isFinite(v)) { pen = "M"; continue; }
        d += `${pen}${x(p.t).toFixed(1)},${y(v).toFixed(1)} `;
        pen = "L";
      }
      if (d) this.svg.append(el("path", { d, class: `line ${s.cls}`, fill: "none" }));
    }
    const last = points[points.length - 1] || {};
    this.readout.replaceChildren(...this.series.map((s) => {
      const span = document.createElement("span");
      span.className = `now ${s.cls}`;
      const value = last[s.key] == null ? "—" : this.format(last[s.key]);
      span.textContent = this.series.length > 1 ? `${s.label} ${value}` : value;
      return span;
    }));
  }
}
