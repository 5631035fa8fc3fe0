// The Prometheus text format (version 0.0.4) parsed into samples; the same counters /metrics
// gives every scraper, read here without a library.

function parseLabels(text, start) {
  // text[start] === "{"; returns [labels, index after "}"]
  const labels = {};
  let i = start + 1;
  while (i < text.length && text[i] !== "}") {
    while (text[i] === " " || text[i] === ",") i++;
    if (text[i] === "}") break;
    const eq = text.indexOf("=", i);
    const key = text.slice(i, eq).trim();
    i = eq + 2; // past ="
    let value = "";
    while (i < text.length && text[i] !== '"') {
      if (text[i] === "\\") {
        const next = text[i + 1];
        value += next === "n" ? "\n" : next;
        i += 2;
      } else {
        value += text[i++];
      }
    }
    labels[key] = value;
    i++; // past the closing quote
  }
  return [labels, i + 1];
}

function parseValue(word) {
  if (word === "+Inf") return Infinity;
  if (word === "-Inf") return -Infinity;
  return Number(word);
}

// [{name, labels, value}] for every sample line; comments and blank lines are skipped.
export function parsePrometheus(text) {
  const samples = [];
  for (const raw of text.split("\n")) {
    const line = raw.trim();
    if (!line || line.startsWith("#")) continue;
    const brace = line.indexOf("{");
    const space = line.indexOf(" ");
    let name, labels = {}, rest;
    if (brace !== -1 && (space === -1 || brace < space)) {
      name = line.slice(0, brace);
      const [parsed, end] = parseLabels(line, brace);
      labels = parsed;
      rest = line.slice(end).trim();
    } else {
      name = line.slice(0, space);
      rest = line.slice(space + 1).trim();
    }
    samples.push({ name, labels, value: parseValue(rest.split(/\s+/)[0]) });
  }
  return new Metrics(samples);
}

export class Metrics {
  constructor(samples) {
    this.samples = samples;
    this.byName = new Map();
    for (const s of samples) {
      if (!this.byName.has(s.name)) this.byName.set(s.name, []);
      this.byName.get(s.name).push(s);
    }
  }

  has(name) {
    return this.byName.has(name);
  }

  // the sum over every sample of `name` whose labels pass `where` (replicas add up)
  sum(name, where = () => true) {
    let total = 0, seen = false;
    for (const s of this.byName.get(name) || []) {
      if (where(s.labels)) { total += s.value; seen = true; }
    }
    return seen ? total : null;
  }

  // Map label value -> summed value (e.g. per adapter, over every replica)
  sumBy(name, label) {
    const out = new Map();
    for (const s of this.byName.get(name) || []) {
      const key = s.labels[label];
      if (key === undefined) continue;
      out.set(key, (out.get(key) || 0) + s.value);
    }
    return out;
  }

  names(prefix) {
    return [...this.byName.keys()].filter((n) => n.startsWith(prefix));
  }
}
