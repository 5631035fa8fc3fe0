"""Several decode steps in one call: how many a decode-only batch may take.

At batch 1 on a CPU a small model's token is a couple of milliseconds of weight streaming,
and the engine's Python around each step (scheduling, the step's tensors, sampling, the
bookkeeping after it) costs a good part of that again, more than its interpretation alone
because the step's weight stream has just pushed the interpreter's data out of the caches.
A run of K steps in one call into the native decode loop (model/native_decode.py: sampling
inside it, greedy rows only) pays that once for K tokens.

What a run may not do is change what anyone gets or when: it is taken only when every running
request is a decode in the batch and nothing waits (a request arriving during the run waits
for it, so a run is kept to RUN_SECONDS by the measured time of a decode-only step of its
size), never past a request's max_tokens or the context, and only where the KV pool has the
blocks for every step without preempting anyone. A request that ends within the run (EOS, a
stop id or string) takes none of its later tokens; their K/V went into its own blocks, freed
with it.
"""

from __future__ import annotations

from loraserve.scheduler.batch import ScheduledBatch
from loraserve.scheduler.scheduler import Scheduler

# a run's length: what a request arriving during it waits at most, as for a prefill chunk
RUN_SECONDS = 0.02
SMOOTHING = 0.3  # weight of the newest measure in a size class's step time


class DecodeRuns:
    def __init__(self, most: int):
        self.most = most  # EngineConfig.decode_steps_per_call
        self.step_s: dict[int, float] = {}  # a decode-only step's seconds, by size class

    def steps(self, sched: Scheduler, batch: ScheduledBatch) -> int:
        """How many steps `batch` runs in one call, their K/V reserved (1: a plain step).
        The caller has checked that the model can run them (ModelRunner.greedy_run)."""
        entries = batch.entries
        if (self.most <= 1 or sched.waiting or batch.admitted or batch.preempted
                or batch.block_copies or batch.num_decodes != len(entries)
                or len(entries) != len(sched.running)):
            return 1
        step = self.step_s.get(len(entries).bit_length())
        if step is None:  # measured by a plain step first
            return 1
        k = min(self.most, int(RUN_SECONDS / max(step, 1e-6)))
        for req, _ in entries:
            k = min(k, req.params.max_tokens - req.num_output_tokens,
                    sched.max_model_len - req.num_tokens)
        if k <= 1 or not sched.kv.pool.can_allocate(
                sum(sched.kv.blocks_needed(req, k) for req, _ in entries)):
            return 1
        for req, _ in entries:
            if sched.kv.can_allocate(req, k):  # it can: the sum fits
                sched.kv.allocate(req, k)
            sched.vtc.charge(req, decode_tokens=k - 1, ahead=1)
        return k

    def observe(self, batch: ScheduledBatch, seconds_per_step: float) -> None:
        """A step of `batch` took this long (a run's time over its steps)."""
        if batch.num_decodes != len(batch.entries) or seconds_per_step <= 0.0:
            return
        size = len(batch.entries).bit_length()
        old = self.step_s.get(size)
        self.step_s[size] = seconds_per_step if old is None else (
            (1 - SMOOTHING) * old + SMOOTHING * seconds_per_step)
