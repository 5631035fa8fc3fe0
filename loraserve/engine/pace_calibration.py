"""Decode-only step times at every batch size class, taken once at startup.

The prefill budget (scheduler/step_pace.py) holds a step that carries prompt tokens to a few
times a decode-only step of the batch its requests will make. That reference is measured per
size class of the decode count (1, 2-3, 4-7, ...), and a class is measured only once a
decode-only step of that size has run. On a fresh engine none has: the first burst of 32
prompts was judged by the reference of the one or two decodes already running, a few
milliseconds, so its prompts went in by a few tokens a step while the early requests decoded
alone, and every later burst ran faster than the first because the references it needed
existed by then.

So the engine runs, before it serves, what a burst of each size would: for n = 1, 2, 4, ...
up to max_num_seqs, n one-token prompts, then decode-only steps of n sequences. Those steps
are timed by the same `Scheduler.observe` as any step, so the references are measurements of
this host and model, not a cost model; they keep following the load as the engine runs
(StepPace's moving average and its probe steps). The same steps warm the kernels and the
allocator for each batch size. Nothing of them stays but the references: their requests end,
their KV blocks are freed (a block is 16 tokens by default, more than a calibration sequence
holds, so the prefix cache keeps nothing of them), the step count and the base model's
prefix-cache counters start from zero.
"""

from __future__ import annotations

import logging
import time

from loraserve.adapters.stats import AdapterStats
from loraserve.types import SamplingParams

log = logging.getLogger("loraserve.engine")

DECODE_STEPS = 3  # per size: the first is a cold start, the moving average weighs the others
ID_PREFIX = "pace-calibration-"


def batch_sizes(max_num_seqs: int, max_sequences: int) -> list[int]:
    """1, 2, 4, ... (one per size class), then the largest batch the engine can run, so the
    top class is measured too. `max_sequences`: what the KV cache and token budget allow."""
    top = max(1, min(max_num_seqs, max_sequences))
    sizes = [1 << i for i in range(top.bit_length())]
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


def calibrate_decode_pace(engine) -> float:
    """Run the calibration batches through `engine` (an idle LLMEngine); seconds it took."""
    c = engine.config
    if c.decode_pace <= 0.0 or engine.has_work:
        return 0.0
    tokens_per_seq = 1 + DECODE_STEPS + 1
    blocks_per_seq = -(-tokens_per_seq // c.block_size)
    max_sequences = min(engine.kv.pool.num_free // blocks_per_seq, c.max_num_batched_tokens)
    if engine.max_model_len < tokens_per_seq or max_sequences < 1:
        return 0.0
    start = time.perf_counter()
    params = SamplingParams(max_tokens=1 + DECODE_STEPS, temperature=0.0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    for n in batch_sizes(c.max_num_seqs, max_sequences):
        for i in range(n):
            engine.add_request([i % vocab], params, request_id=f"{ID_PREFIX}{n}-{i}",
                               client_id=ID_PREFIX)
        while engine.has_work:
            engine.step()
    engine.num_steps = 0
    engine.base_prefix = AdapterStats()
    seconds = time.perf_counter() - start
    log.info("decode pace calibrated at batch sizes up to %d in %.2f s", n, seconds)
    return seconds
