// The playground: one prompt sent to several models at once (adapters and the base model),
// streamed side by side, then a word diff of the greedy outputs against the first model.
import { wordDiff } from "./diff.js";
import { streamEvents } from "./sse.js";

function number(form, name) {
  const raw = form.elements[name].value.trim();
  return raw === "" ? null : Number(raw);
}

export class Playground {
  constructor({ form, models, outputs, diff }) {
    this.form = form;
    this.modelsBox = models;
    this.outputs = outputs;
    this.diff = diff;
    this.controller = null;
    this.known = null; // model ids last listed (to keep the user's ticks)
    form.addEventListener("submit", (e) => { e.preventDefault(); this.run(); });
    form.elements.stop.addEventListener("click", () => this.controller?.abort());
  }

  // the models to choose from; the first time, the base model and two adapters are ticked
  setModels(cards) {
    const ids = cards.map((c) => c.id);
    if (this.known && ids.join("\n") === this.known.join("\n")) return;
    const ticked = new Set(this.known ? this.selected() : [
      ...cards.filter((c) => c.parent == null).map((c) => c.id),
      ...cards.filter((c) => c.parent != null && !c.id.includes("@")).slice(0, 2).map((c) => c.id)]);
    this.known = ids;
    this.modelsBox.replaceChildren(...ids.map((id) => {
      const label = document.createElement("label");
      const box = document.createElement("input");
      box.type = "checkbox";
      box.name = "model";
      box.value = id;
      box.checked = ticked.has(id);
      label.append(box, ` ${id}`);
      return label;
    }));
  }

  selected() {
    return [...this.modelsBox.querySelectorAll("input[name=model]:checked")].map((b) => b.value);
  }

  request(model) {
    const f = this.form;
    const prompt = f.elements.prompt.value;
    const body = { model, max_tokens: number(f, "max_tokens") ?? 64,
                   temperature: number(f, "temperature") ?? 1, top_p: number(f, "top_p") ?? 1 };
    const seed = number(f, "seed");
    if (seed != null) body.seed = seed;
    if (f.elements.mode.value === "chat") {
      return ["/v1/chat/completions", { ...body, messages: [{ role: "user", content: prompt }] }];
    }
    return ["/v1/completions", { ...body, prompt }];
  }

  panel(model) {
    const article = document.createElement("article");
    article.className = "output";
    article.dataset.model = model;
    const h = document.createElement("h3");
    h.textContent = model;
    const text = document.createElement("pre");
    text.className = "text";
    const meta = document.createElement("p");
    meta.className = "meta";
    meta.textContent = "waiting…";
    article.append(h, text, meta);
    this.outputs.append(article);
    return { article, text, meta };
  }

  async runOne(model, signal) {
    const { article, text, meta } = this.panel(model);
    const [path, body] = this.request(model);
    const chat = path.includes("chat");
    const t0 = performance.now();
    let first = null, chunks = 0, reason = null, out = "";
    try {
      await streamEvents(path, body, (event) => {
        const choice = event.choices && event.choices[0];
        if (!choice) return;
        const piece = chat ? choice.delta?.content : choice.text;
        if (piece) {
          if (first == null) first = performance.now() - t0;
          out += piece;
          chunks += 1;
          text.textContent = out;
        }
        if (choice.finish_reason) reason = choice.finish_reason;
        meta.textContent = `${chunks} chunks · first after ${Math.round(first ?? 0)} ms`;
      }, signal);
      const total = (performance.now() - t0) / 1000;
      meta.textContent = `done (${reason || "end"}) · ${chunks} chunks · first after ` +
        `${Math.round(first ?? 0)} ms · ${total.toFixed(2)} s`;
      article.classList.add("done");
      return { model, text: out, ok: true };
    } catch (e) {
      article.classList.add("failed");
      meta.textContent = signal.aborted ? "stopped" : `error: ${e.message}`;
      return { model, text: out, ok: false };
    }
  }

  async run() {
    const models = this.selected();
    this.outputs.replaceChildren();
    this.diff.replaceChildren();
    if (!models.length) {
      this.diff.textContent = "Tick at least one model.";
      return;
    }
    this.controller?.abort();
    const controller = this.controller = new AbortController();
    this.form.elements.run.disabled = true;
    this.form.elements.stop.disabled = false;
    try {
      const results = await Promise.all(models.map((m) => this.runOne(m, controller.signal)));
      if (this.controller === controller) this.showDiff(results);
    } finally {
      if (this.controller === controller) {
        this.form.elements.run.disabled = false;
        this.form.elements.stop.disabled = true;
        this.controller = null;
      }
    }
  }

  showDiff(results) {
    const done = results.filter((r) => r.ok);
    if (done.length < 2) return;
    const heading = document.createElement("h3");
    if (number(this.form, "temperature") !== 0) {
      heading.textContent = "Diff: set temperature to 0 to compare greedy outputs.";
      this.diff.append(heading);
      return;
    }
    const [ref, ...rest] = done;
    heading.textContent = `Greedy outputs, word by word against ${ref.model}`;
    this.diff.append(heading);
    for (const other of rest) {
      const block = document.createElement("div");
      block.className = "diff-pair";
      block.dataset.model = other.model;
      const title = document.createElement("h4");
      const parts = wordDiff(ref.text, other.text);
      const same = parts.every((p) => p.op === "same");
      title.textContent = `${ref.model} → ${other.model}${same ? ": identical" : ""}`;
      const body = document.createElement("p");
      body.className = "diff-text";
      for (const p of parts) {
        const span = document.createElement(p.op === "add" ? "ins" : p.op === "del" ? "del" : "span");
        span.textContent = p.text;
        body.append(span);
      }
      block.append(title, body);
      this.diff.append(block);
    }
  }
}
