"""The prefill token budget of one step, adapted to measured step costs (Sarathi-Serve's
stall-free batching, with the budget derived from what steps cost on this machine).

A step costs about `fixed + per_token * tokens`: `fixed` is what every step pays whatever its
size (reading the weights, launching kernels, Python), `per_token` what each row adds. Both
are fitted online, by least squares over recent steps with exponential forgetting, from the
times the engine reports (`observe`). A decode-only step of D sequences then costs
`fixed + per_token * D`, and a step that also carries P prefill tokens stays within `factor`
times that when

    P <= (factor - 1) * (fixed / per_token + D)

which is the budget `prefill_budget` returns (within [min_chunk, max_tokens]). With nothing
decoding, D counts as one: a request that arrives mid-prefill waits at most one such step.

Why measured rather than a fixed token count: the same chunk costs about as much as a decode
step on a GPU and a hundred decode steps on a small CPU, and a chunk deep in a long prompt
costs more than the first (attention over everything before it); forgetting follows both.
Before the first step nothing caps the budget; until two step sizes have been seen, `fixed`
cannot be told apart from `per_token`, and the budget assumes `fixed` is zero, the smallest
(safest) estimate.
"""

from __future__ import annotations


class StepPace:
    def __init__(self, factor: float, max_tokens: int, min_chunk: int = 16,
                 forget: float = 0.8):
        self.factor = factor  # 0: no cap, every step may take max_tokens
        self.max_tokens = max_tokens
        self.min_chunk = min(min_chunk, max_tokens)
        self.forget = forget  # weight of the past at each observation
        self.weight = 0.0  # exponentially weighted sums over steps: 1, T, t, T^2, T*t
        self.sum_t = self.sum_s = self.sum_tt = self.sum_ts = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A step of `num_tokens` tokens (decodes + prefill) took `seconds`."""
        if num_tokens <= 0 or seconds <= 0:
            return
        f, t = self.forget, float(num_tokens)
        self.weight = f * self.weight + 1.0
        self.sum_t = f * self.sum_t + t
        self.sum_s = f * self.sum_s + seconds
        self.sum_tt = f * self.sum_tt + t * t
        self.sum_ts = f * self.sum_ts + t * seconds

    def cost(self) -> tuple[float, float] | None:
        """(fixed, per_token) seconds, or None before any step was seen."""
        w = self.weight
        if w == 0.0:
            return None
        mean_t, mean_s = self.sum_t / w, self.sum_s / w
        var = self.sum_tt / w - mean_t * mean_t
        cov = self.sum_ts / w - mean_t * mean_s
        # sizes barely differ: the slope is noise; put the whole cost on the tokens
        if var <= (0.05 * mean_t) ** 2 or cov <= 0.0:
            return 0.0, mean_s / mean_t
        per_token = cov / var
        fixed = mean_s - per_token * mean_t
        if fixed < 0.0:  # a negative intercept is noise too: fall back to the ratio
            return 0.0, mean_s / mean_t
        return fixed, per_token

    def prefill_budget(self, num_decodes: int) -> int:
        """Prefill tokens this step may carry beside `num_decodes` decodes."""
        if self.factor <= 0.0:
            return self.max_tokens
        cost = self.cost()
        if cost is None:  # nothing measured yet
            return self.max_tokens
        fixed, per_token = cost
        budget = (self.factor - 1.0) * (fixed / per_token + max(num_decodes, 1))
        return int(max(self.min_chunk, min(self.max_tokens, budget)))
