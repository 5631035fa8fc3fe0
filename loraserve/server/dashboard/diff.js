// A word-level diff (longest common subsequence), to compare two adapters' greedy outputs.

// words with the whitespace that follows them, so the pieces join back into the text
export function words(text) {
  return text.match(/\s+|\S+\s*/g) || [];
}

const MAX_CELLS = 4_000_000; // beyond this (about 2000 x 2000 words) the texts are just shown

// [{op: "same" | "del" | "add", text}], consecutive pieces of one kind merged.
export function wordDiff(a, b) {
  const A = words(a), B = words(b);
  const n = A.length, m = B.length;
  const out = [];
  const push = (op, text) => {
    const last = out[out.length - 1];
    if (last && last.op === op) last.text += text;
    else out.push({ op, text });
  };
  if ((n + 1) * (m + 1) > MAX_CELLS) {
    if (a) push("del", a);
    if (b) push("add", b);
    return out;
  }
  // lcs[i][j]: the longest common subsequence of A[i:] and B[j:]
  const width = m + 1;
  const lcs = new Uint32Array((n + 1) * width);
  for (let i = n - 1; i >= 0; i--) {
    for (let j = m - 1; j >= 0; j--) {
      lcs[i * width + j] = A[i] === B[j]
        ? lcs[(i + 1) * width + j + 1] + 1
        : Math.max(lcs[(i + 1) * width + j], lcs[i * width + j + 1]);
    }
  }
  let i = 0, j = 0;
  while (i < n && j < m) {
    if (A[i] === B[j]) { push("same", A[i]); i++; j++; }
    else if (lcs[(i + 1) * width + j] >= lcs[i * width + j + 1]) push("del", A[i++]);
    else push("add", B[j++]);
  }
  while (i < n) push("del", A[i++]);
  while (j < m) push("add", B[j++]);
  return out;
}
