"""The prefill token budget of one step, steered by measured step times (Sarathi-Serve's
stall-free batching, with the budget found by feedback instead of fixed in advance).

The goal: a step that carries prefill tokens beside D decodes takes at most `factor` times a
decode-only step of those decodes. Both times are measured as the engine runs (`observe`):
  - decode-only steps give the reference, an exponential average of their times per size
    class of D (1, 2-3, 4-7, ...: a step of 32 decodes costs several of one, so a reference
    taken at one size misjudges steps at another). A step whose D has no reference yet is
    left decode-only (`prefill_budget` answers 0), once, to take one. While a long prompt
    keeps every step busy, one step in `probe_every` is left decode-only on purpose, so the
    reference follows the current load;
  - while one client's requests wait, its decodes are held to the pace of the batch they
    will all make (`rows`: running and waiting, up to the seats; the scheduler passes 0 when
    several clients share the engine, where each client's decodes keep their own pace): they
    will decode at that pace once the waiting have joined, and holding a burst's first two
    decodes to their own pace starved thirty prompts behind them (a few tokens a step each);
  - each step with prefill gives the ratio of its time to the reference, and the budget is
    scaled by (factor / ratio), damped and bounded (halved at most, grown by at most 1.4x,
    per step): over it shrinks, under it grows, only when the budget was what limited the
    step (a few prompt tokens under budget say nothing about a larger budget).
The budget stays within [min_chunk, max_tokens]: a long prompt always progresses. Before the
first step is measured nothing caps it (the engine measures every step; model-free callers
schedule as if uncapped); from then on it starts at `initial` until the loop moves it. A step
with no decodes is bounded by the last budget: a request that arrives during it waits at most
that long (a step of max_tokens is long on a small CPU, and a newcomer's first token waits for
it). Such a step only grows the budget, up to the bound of the batch its work will make
(`rows`, as above): one client's burst that arrives all at once prefills with no decodes for
many steps, and a budget left small by the end of the burst before would cut the whole of it
into chunks far under what the bound allows, each one reading every weight again. It never
shrinks the budget: nobody's pace was slowed.

With `average` (between clients, scheduler.py), the bound holds on average too: a step over
`factor` x the reference leaves a debt of its excess, and until later steps have paid it (a
reference step pays `factor` - 1 references) the budget is 0. A chunk that costs more than
the bound even at `min_chunk` (deep in a long prompt, on a slow host) then runs only every
few steps, so the decodes' average pace holds however expensive the chunk is.

Why feedback on measured times rather than a token count fixed in advance or derived from a
fitted cost model: the same chunk costs about one decode step on a GPU and a hundred on a
small CPU, a chunk deep in a long prompt costs more than the first (attention over everything
before it), and on a shared host every step slows with the other processes. A ratio of two
times measured close together is immune to the last, and the loop follows the first two. A
fitted cost model (fixed + per-token) is not: its intercept absorbs the host's contention as
"fixed cost", which opens the budget exactly when steps are slowest.
"""

from __future__ import annotations


class StepPace:
    def __init__(self, factor: float, max_tokens: int, min_chunk: int = 16,
                 initial: int = 256, probe_every: int = 8, smoothing: float = 0.3,
                 average: bool = False):
        self.factor = factor  # 0: no cap, every step may take max_tokens
        self.max_tokens = max_tokens
        self.min_chunk = min(min_chunk, max_tokens)
        self.budget = float(max(self.min_chunk, min(initial, max_tokens)))
        self.probe_every = probe_every
        self.smoothing = smoothing  # weight of the newest decode-only time in the average
        self.decode_s: dict[int, float] = {}  # reference per size class of the decodes
        self.steps_since_reference = 0
        self.observed = False
        self.average = average
        self.debt = 0.0  # seconds over the bound not yet paid back (with `average`)
        self.rows = 0  # the batch size the last prefill_budget was asked for

    def reference(self, num_decodes: int) -> float | None:
        """A decode-only step's time at `num_decodes` decodes (its size class), if measured."""
        return self.decode_s.get(num_decodes.bit_length())

    def judged_by(self, num_decodes: int, rows: int) -> float | None:
        """The reference a step of `num_decodes` decodes is held to: a decode-only step of the
        batch its waiting work will make (`rows`), or of the nearest size measured below that,
        down to the decodes' own."""
        for size in range(max(rows, num_decodes).bit_length(), num_decodes.bit_length() - 1,
                          -1):
            if size in self.decode_s:
                return self.decode_s[size]
        return None

    def prefill_budget(self, num_decodes: int, long_prefill: bool = False,
                       rows: int = 0) -> int:
        """Prefill tokens this step may carry beside `num_decodes` decodes. `long_prefill`: a
        prompt is being prefilled over several steps, so decode-only steps do not come by
        themselves; then one in `probe_every` is one (the answer is 0). `rows`: the batch
        the running and waiting requests will make (judged_by)."""
        self.rows = rows
        if self.factor <= 0.0 or not self.observed:  # nothing measured yet: no cap
            return self.max_tokens
        if num_decodes == 0:  # the last budget holds: a newcomer waits at most one such step
            return int(self.budget)
        if self.reference(num_decodes) is None or (
                long_prefill and self.steps_since_reference >= self.probe_every):
            return 0
        if self.debt > 0.0:
            return 0
        return int(self.budget)

    def observe(self, num_decodes: int, num_prefill: int, seconds: float) -> None:
        """A step of `num_decodes` decodes and `num_prefill` prefill tokens took `seconds`."""
        if seconds <= 0.0 or self.factor <= 0.0:
            return
        self.observed = True
        ref = self.reference(num_decodes)
        if self.average and num_decodes > 0 and ref is not None:
            self.debt = max(0.0, self.debt + seconds - self.factor * ref)
        if num_prefill == 0:
            if num_decodes > 0:
                a = self.smoothing if ref is not None else 1.0
                self.decode_s[num_decodes.bit_length()] = (1 - a) * (ref or 0.0) + a * seconds
                self.steps_since_reference = 0
            return
        self.steps_since_reference += 1
        judge = self.judged_by(num_decodes, self.rows)
        if judge is None:
            return  # nothing to judge it by
        ratio = seconds / judge
        if ratio <= self.factor and num_prefill < 0.9 * self.budget:
            return  # the budget did not bind: no evidence that more would fit
        if num_decodes == 0 and ratio > self.factor:
            return  # nobody it could have slowed
        scale = min(2.0, max(0.25, self.factor / ratio)) ** 0.5
        self.budget = max(self.min_chunk, min(self.max_tokens, self.budget * scale))
