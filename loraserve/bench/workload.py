"""Synthetic request source: arrival times, adapter choice, prompt and output lengths.

Everything is drawn from one seeded numpy Generator, so a (config, seed) pair always gives the
same request list, which is what makes two server configurations comparable.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

ADAPTER_DISTS = ("uniform", "zipf", "bursty", "distinct")
ARRIVALS = ("poisson", "fixed")
PROMPT_MODES = ("token-ids", "text")

# Common English words that BPE vocabularies keep as one token each (with a leading space),
# so "n words" is close to "n tokens" when no tokenizer is at hand.
_WORDS = (
    "the of and to in is was for on are with as be at by this had not but from or have an they "
    "which one you were her all she there would their we him been has when who will more no if "
    "out so said what up its about into than them can only other new some could time these two "
    "may then do first any my now such like our over man me even most made after also did many "
    "before must through back years where much your way well down should because each just"
).split()


@dataclass(frozen=True)
class WorkloadConfig:
    num_requests: int = 100
    request_rate: float = float("inf")  # req/s; inf = every request at t=0
    arrival: str = "poisson"  # poisson | fixed
    adapters: tuple[str, ...] = ()
    adapter_dist: str = "uniform"
    zipf_alpha: float = 1.0
    burst_size: int = 100  # requests per burst (bursty)
    burst_groups: tuple[int, ...] | None = None  # adapter-group sizes, cycled; None = growing
    base_fraction: float = 0.0  # share of requests sent to the base model
    base_model: str = ""
    input_len: int = 128
    input_len_max: int | None = None  # given: uniform in [input_len, input_len_max]
    output_len: int = 32
    output_len_max: int | None = None
    prompt_mode: str = "token-ids"  # token-ids (exact lengths) | text (~1 token per word)
    token_id_range: tuple[int, int] = (100, 10000)  # [low, high): clear of special tokens
    shared_prefix_len: int = 0  # leading prompt tokens identical across requests
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError("num_requests must be >= 1")
        if not self.request_rate > 0:
            raise ValueError("request_rate must be > 0 (use inf for all at once)")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {ARRIVALS}")
        if self.adapter_dist not in ADAPTER_DISTS:
            raise ValueError(f"adapter_dist must be one of {ADAPTER_DISTS}")
        if self.prompt_mode not in PROMPT_MODES:
            raise ValueError(f"prompt_mode must be one of {PROMPT_MODES}")
        if not 0.0 <= self.base_fraction <= 1.0:
            raise ValueError("base_fraction must be in [0, 1]")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("input_len and output_len must be >= 1")
        if self.shared_prefix_len >= self.input_len:
            raise ValueError("shared_prefix_len must be smaller than input_len")


@dataclass
class BenchRequest:
    index: int
    arrival: float  # seconds after the start of the run
    model: str  # the `model` field: an adapter name or the base model's name
    adapter: str | None  # None for base-model requests
    prompt: list[int] | str
    input_len: int  # tokens asked for (exact in token-ids mode)
    output_len: int  # max_tokens, sent with ignore_eos so it is exact
    extra: dict = field(default_factory=dict)


def arrival_times(n: int, rate: float, kind: str, rng: np.random.Generator) -> np.ndarray:
    """Offsets in seconds; the first request goes at 0."""
    if np.isinf(rate):
        return np.zeros(n)
    if kind == "fixed":
        gaps = np.full(n - 1, 1.0 / rate)
    else:  # Poisson process: exponential gaps with mean 1/rate
        gaps = rng.exponential(1.0 / rate, size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def zipf_probs(n: int, alpha: float) -> np.ndarray:
    """P(rank k) ∝ 1/k^alpha, rank 1 = first adapter in the list."""
    w = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** alpha
    return w / w.sum()


def default_burst_groups(n: int) -> list[int]:
    """Growing groups step, 2*step, ... up to all n adapters, then the sequence restarts.

    step is 10 for 40+ adapters and n/4 below that, so small lists still get real bursts.
    """
    step = min(10, max(1, n // 4))
    return list(range(step, n, step)) + [n]


def bursty_groups(adapters: list[str], num_bursts: int, sizes: list[int]) -> list[list[str]]:
    """The adapter group of each burst: consecutive slices of the list, wrapping around."""
    n, start, groups = len(adapters), 0, []
    for size in itertools.islice(itertools.cycle(sizes), num_bursts):
        size = max(1, min(size, n))
        groups.append([adapters[(start + j) % n] for j in range(size)])
        start = (start + size) % n
    return groups


def choose_adapters(cfg: WorkloadConfig, n: int, rng: np.random.Generator) -> list[str]:
    """n adapter names following cfg.adapter_dist (base requests are handled by the caller)."""
    names = list(cfg.adapters)
    k = len(names)
    if cfg.adapter_dist == "uniform":
        return [names[i] for i in rng.integers(0, k, size=n)]
    if cfg.adapter_dist == "zipf":
        return [names[i] for i in rng.choice(k, size=n, p=zipf_probs(k, cfg.zipf_alpha))]
    if cfg.adapter_dist == "distinct":
        return [names[i % k] for i in range(n)]
    # bursty: request i belongs to burst i // burst_size and draws uniformly from its group
    num_bursts = -(-n // cfg.burst_size)
    sizes = list(cfg.burst_groups) if cfg.burst_groups else default_burst_groups(k)
    groups = bursty_groups(names, num_bursts, sizes)
    return [groups[i // cfg.burst_size][rng.integers(0, len(groups[i // cfg.burst_size]))]
            for i in range(n)]


def _lengths(lo: int, hi: int | None, n: int, rng: np.random.Generator) -> list[int]:
    if hi is None or hi <= lo:
        return [lo] * n
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)]


def make_prompt(
    n_tokens: int, cfg: WorkloadConfig, rng: np.random.Generator, prefix: list[int]
) -> list[int] | str:
    lo, hi = cfg.token_id_range
    ids = prefix + [int(x) for x in rng.integers(lo, hi, size=n_tokens - len(prefix))]
    if cfg.prompt_mode == "token-ids":
        return ids
    # The same ids pick words, so the shared prefix stays shared in text mode too.
    return " ".join(_WORDS[i % len(_WORDS)] for i in ids)


def generate_workload(cfg: WorkloadConfig) -> list[BenchRequest]:
    rng = np.random.default_rng(cfg.seed)
    n = cfg.num_requests
    times = arrival_times(n, cfg.request_rate, cfg.arrival, rng)

    # Exactly round(n * fraction) base requests; all of them when there are no adapters.
    n_base = n if not cfg.adapters else int(round(n * cfg.base_fraction))
    if n_base and not cfg.base_model:
        raise ValueError("base-model requests need a base model name")
    is_base = np.zeros(n, dtype=bool)
    is_base[rng.choice(n, size=n_base, replace=False)] = True
    # Adapters are drawn for the adapter requests only, so bursty/distinct order is kept.
    chosen = iter(choose_adapters(cfg, n - n_base, rng) if n_base < n else [])

    in_lens = _lengths(cfg.input_len, cfg.input_len_max, n, rng)
    out_lens = _lengths(cfg.output_len, cfg.output_len_max, n, rng)
    lo, hi = cfg.token_id_range
    prefix = [int(x) for x in rng.integers(lo, hi, size=cfg.shared_prefix_len)]
    reqs = []
    for i in range(n):
        adapter = None if is_base[i] else next(chosen)
        reqs.append(BenchRequest(
            index=i, arrival=float(times[i]), model=adapter or cfg.base_model, adapter=adapter,
            prompt=make_prompt(in_lens[i], cfg, rng, prefix), input_len=in_lens[i],
            output_len=out_lens[i],
        ))
    return reqs
