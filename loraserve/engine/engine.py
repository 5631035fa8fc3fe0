"""The engine: one base model, its adapters, and a step that runs every kind of batch.

Single-threaded by design: whoever calls `step()` (and the commands below) owns the
scheduler, the KV pool and the adapter store. The server runs it on its own thread
(engine/async_engine.py) and talks to it only through engine/messages.py.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

from loraserve.adapters.disk_loader import DiskLoader
from loraserve.adapters.residency import ResidencyLimits, residency_class
from loraserve.adapters.slot_pool import LoraSlotPool
from loraserve.adapters.stats import AdapterStats
from loraserve.adapters.store import AdapterStore
from loraserve.config import EngineConfig
from loraserve.engine import messages as M
from loraserve.engine.adapter_admin import AdapterAdmin
from loraserve.engine.invariants import InvariantReport, check_engine
from loraserve.engine.kv_sizing import size_kv_cache
from loraserve.engine.output_processor import OutputProcessor, to_output
from loraserve.engine.pace_calibration import calibrate_decode_pace
from loraserve.engine.request_intake import RequestIntake
from loraserve.engine.runner import ModelRunner
from loraserve.kvcache.manager import KVCacheManager
from loraserve.lora.backends import create_lora_backend, pool_tile_width
from loraserve.model.attention import create_attention_backend
from loraserve.model.base_weights import ModelBaseWeights
from loraserve.model.bundled import gguf_source, resolve_model_path
from loraserve.model.loader import load_model
from loraserve.model.structured import GrammarCompiler
from loraserve.model.tokenizer import Tokenizer
from loraserve.ops.native_memory import MemoryTrimmer
from loraserve.request import Request
from loraserve.scheduler.batch import ScheduledBatch, StepOutput
from loraserve.scheduler.decode_runs import DecodeRuns
from loraserve.scheduler.scheduler import Scheduler
from loraserve.types import FinishReason, RequestOutput

log = logging.getLogger("loraserve.engine")


class LLMEngine(RequestIntake, AdapterAdmin):
    def __init__(self, model: str | Path | None = None, config: EngineConfig | None = None,
                 device: str | torch.device | None = None):
        """Wiring only: every choice is made by `EngineConfig.resolve` (device, dtypes,
        adapter memory, backends, CUDA graphs) and by the model's own config."""
        self.config = c = (config or EngineConfig()).resolve(device)
        if c.num_threads:
            torch.set_num_threads(c.num_threads)
        self.device, self.dtype = torch.device(c.device), getattr(torch, c.activation_dtype)
        self.model_path = resolve_model_path(model)
        self.model = load_model(self.model_path, self.dtype, self.device, c.quantization,
                                gguf_source(model) if c.quantization == "gguf" else None,
                                weight_dtype=getattr(torch, c.dtype))
        self.model_config = mc = self.model.config
        self.base_weights = ModelBaseWeights(self.model)  # for DoRA norms at adapter reads
        self.tokenizer = Tokenizer(self.model_path)
        self.max_model_len = min(c.max_model_len or 10**9, mc.max_position_embeddings)
        limits = ResidencyLimits.of(c)
        self.slot_pool = LoraSlotPool(
            mc, residency_class(c.lora_memory).initial_slots(limits), c.max_lora_rank,
            dtype=c.lora_torch_dtype, device=self.device,
            tile_width=pool_tile_width(c.lora_backend, c.lora_torch_dtype, self.device))
        # after the weights and the slot pool: on a GPU the cache gets what they leave
        self.kv_sizing = size_kv_cache(c, mc, self.device, self.dtype)
        num_blocks = self.kv_sizing.tokens // c.block_size
        # decode graphs' padding rows write to a block of their own, within the budget. None
        # for experts: each expert's matmul is sized by the routing, read back every layer
        # (model/moe.py), which a captured graph cannot do
        graphs = not c.disable_cuda_graph and num_blocks > 1 and not mc.num_experts
        num_blocks -= graphs
        self.kv = KVCacheManager(num_blocks, c.block_size, c.enable_prefix_caching)
        self.store = AdapterStore(self.slot_pool, DiskLoader(self.read_adapter), limits,
                                  memory=c.lora_memory, reserved_names=frozenset({mc.name}),
                                  max_versions=c.max_adapter_versions)
        lora = create_lora_backend(self.slot_pool, c.lora_backend)
        attention = create_attention_backend(c.attention_backend, c.block_size, self.device)
        eos = frozenset(self.tokenizer.eos_token_ids) | frozenset(mc.eos_token_ids)
        self.runner = ModelRunner(self.model, c, num_blocks, self.device, attention, lora, eos,
                                  scratch_block=graphs)
        if graphs:
            self.runner.enable_decode_graphs(c.cuda_graph_max_bs, self.max_model_len)
        self.scheduler = Scheduler(c, self.kv, self.store, eos, self.max_model_len,
                                   mc.attention_cost_per_position)
        # adapters change no token embedding, so every route shares the base's grammars
        self.grammars = GrammarCompiler(self.tokenizer.hf, mc.vocab_size, eos)
        self.output_processor = OutputProcessor(self.tokenizer)
        # runs only where the native loop can take them (ModelRunner.greedy_run): on a CPU
        self.decode_runs = DecodeRuns(c.decode_steps_per_call)
        self.info = M.EngineInfo(
            model_name=mc.name, model_path=str(self.model_path), model_config=mc,
            max_model_len=self.max_model_len, kv_capacity_tokens=self.kv.capacity_tokens,
            max_lora_rank=c.max_lora_rank, allow_pickle_adapters=c.allow_pickle_adapters,
            lora_backend=lora.name)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.base_prefix = AdapterStats()  # the base model's prefix-cache counters
        self.trimmer = MemoryTrimmer()  # adapter churn frees across threads: give pages back
        if c.pace_calibration:
            calibrate_decode_pace(self)

    # --- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched, store = self.scheduler, self.store
        load_errors = store.prepare(sched.running_adapters(), sched.waiting_adapters())
        ended = sched.fail_waiting(load_errors) + self._end_stalled()
        batch = sched.schedule()
        self._count_prefix_hits(batch.admitted)
        sampled = []
        if batch:
            self.num_steps += 1
            self.runner.copy_blocks(batch.block_copies)  # forks' copies of a partial block
            start = time.perf_counter()
            outputs, broken = self._run(batch, store.bind(batch.adapter_uids))
            if not broken:  # what steps cost sizes the next steps' prefill budget
                seconds = (time.perf_counter() - start) / len(outputs)
                sched.observe(batch, seconds)
                self.decode_runs.observe(batch, seconds)
            ended += broken
            for i, output in enumerate(outputs):
                if i:  # a run's later step: those its earlier tokens ended take none
                    batch = batch.unfinished()
                    output = output.only({req.request_id for req, _ in batch.entries})
                got = sched.update_from_output(batch, output)
                ended += sched.end_without_token(batch, output)
                for req in self.output_processor.process(got):  # ended by a stop string
                    sched.finish(req, FinishReason.STOP)
                sampled += got
            sampled = list(dict.fromkeys(sampled))  # one output a request: its state after all
        elif sched.waiting and not sched.running:
            store.wait_for_loads(timeout=0.05)  # only an adapter load can make progress
        self.trimmer.maybe_trim()
        return [self._output(r) for r in ended + sampled]

    def _run(self, batch: ScheduledBatch, slots: dict[int, int]
             ) -> tuple[list[StepOutput], list[Request]]:
        """The batch's step, or a run of its next decode steps in one call where it may take
        one (scheduler/decode_runs.py): each step's output, and the requests it broke."""
        run = self.runner.greedy_run(batch, slots)
        steps = 1 if run is None else self.decode_runs.steps(self.scheduler, batch)
        if steps > 1:
            try:
                return self.runner.execute_greedy_run(run, steps), []
            except Exception:  # its blocks stay reserved for the steps to come
                log.exception("a run of %d decode steps failed; taking one step", steps)
        output, broken = self._execute(batch, slots)
        return [output], broken

    def _execute(self, batch: ScheduledBatch, slots: dict[int, int]) -> tuple[StepOutput,
                                                                            list[Request]]:
        """Run the batch. If the forward pass or sampling raises, contain it: run each request
        alone (its RNG as before the failed attempt) and end only those that still fail, so
        an unforeseen bug costs one request, not everyone in its step."""
        rng = self.runner.rng_states(batch)
        try:
            return self.runner.execute(batch, slots), []
        except Exception:
            log.exception("engine step failed; retrying its %d requests one by one",
                          len(batch.entries))
        self.runner.restore_rng_states(rng)
        outputs, broken = [], []
        for seq in list(batch.entries):
            try:
                outputs.append(self.runner.execute(ScheduledBatch([seq]), slots))
            except Exception:
                log.exception("request %s failed in the engine step", seq.request.request_id)
                batch.drop(seq.request)
                self.scheduler.finish(seq.request, FinishReason.ERROR,
                                      "internal error while computing this request", 500)
                broken.append(seq.request)
        return StepOutput.concat(outputs), broken

    def _end_stalled(self) -> list[Request]:
        """End the paused requests whose client has not read for stalled_stream_timeout."""
        timeout = self.config.stalled_stream_timeout
        stalled = self.scheduler.stalled(timeout)
        for req in stalled:
            self.scheduler.finish(req, FinishReason.ERROR, f"the client did not read its stream "
                                  f"for {timeout:g} s", error_status=408)
        return stalled

    def expire_stalled(self) -> list[RequestOutput]:
        """Between steps, when nothing runs: the outputs of the requests `_end_stalled` ends."""
        return [self._output(r) for r in self._end_stalled()]

    def pause(self, request_id: str) -> bool:
        """Its client does not read: out of the batch (seat and KV freed) until `resume`."""
        req = self.requests.get(request_id)
        return req is not None and self.scheduler.pause(req)

    def resume(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        return req is not None and self.scheduler.resume(req)

    @property
    def has_paused(self) -> bool:
        return bool(self.scheduler.paused)

    def _count_prefix_hits(self, admitted: list[Request]) -> None:
        """Prompt tokens asked of the prefix cache, and found, per adapter (first admission)."""
        for req in admitted:
            if req.prefix_counted or req.num_cached_tokens is None:
                continue
            req.prefix_counted = True
            stats = self.base_prefix if req.adapter_uid is None else \
                self.store.stats(req.adapter_uid)
            stats.prefix_queries += len(req.prompt_token_ids)
            stats.prefix_hits += req.num_cached_tokens

    def _output(self, req: Request) -> RequestOutput:
        if req.is_finished:
            self._retire(req)
        return to_output(req)

    def _retire(self, req: Request) -> None:
        """The one place a finished request lets go of the engine: its adapter refcount is
        released here, exactly once (the uid is cleared on the way)."""
        self.requests.pop(req.request_id, None)
        self.output_processor.drop(req.request_id)
        req.fork_parent, req.forks = None, []  # no reference cycles outlive the request
        if req.adapter_uid is not None:
            uid, req.adapter_uid = req.adapter_uid, None
            self.store.release(uid)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def has_running(self) -> bool:
        return bool(self.scheduler.running)

    # --- requests (their way in: engine/request_intake.py) --------------------------------
    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        for fork in list(req.forks):  # its forks go with it
            self.abort(fork.request_id)
        self.scheduler.finish(req, FinishReason.ABORT)
        return self._output(req)

    # --- between steps (adapter registration: engine/adapter_admin.py) -------------------
    def snapshot(self) -> M.EngineSnapshot:
        pool = self.kv.pool
        sched = self.scheduler
        waiting = Counter(r.adapter_uid for r in sched.waiting)
        base_running = sum(1 for r in sched.running if r.adapter_uid is None)
        return M.EngineSnapshot(
            running=len(sched.running), waiting=len(sched.waiting),
            paused=len(sched.paused),
            kv_blocks_used=pool.num_used, kv_blocks_total=pool.num_blocks,
            num_steps=self.num_steps,
            adapters=tuple(replace(a, waiting=waiting[a.uid]) for a in self.store.snapshot()),
            model_name=self.info.model_name, base_prefix_queries=self.base_prefix.prefix_queries,
            base_prefix_hits=self.base_prefix.prefix_hits, kv_blocks_cached=pool.num_cached,
            base_waiting=waiting[None], base_in_flight=base_running + waiting[None])

    def check_invariants(self, awaited: tuple[str, ...] = ()) -> InvariantReport:
        """Every KV block, adapter refcount, slot and load accounted for (engine/invariants.py);
        call between steps. `.raise_if_failed()` turns violations into an InvariantError."""
        return check_engine(self, awaited)

    def handle(self, cmd: M.EngineCommand):
        """Apply one command between steps; its reply (or the exception it raised)."""
        match cmd:
            case M.AddRequest():
                return self.add_request(cmd.prompt, cmd.params, cmd.lora_name, cmd.request_id,
                                        cmd.origin, cmd.fork_of, cmd.client_id, cmd.grammar)
            case M.AbortRequest():
                return self.abort(cmd.request_id)
            case M.PauseRequest():
                return self.pause(cmd.request_id)
            case M.ResumeRequest():
                return self.resume(cmd.request_id)
            case M.CheckAdapterLoad():
                return self.store.check_new(cmd.name, cmd.path, cmd.pinned, cmd.replace)
            case M.LoadAdapter():
                return self.load_lora_adapter(cmd.name, cmd.path, cmd.pinned, cmd.weights,
                                              replace=cmd.replace, version=cmd.version,
                                              owned=cmd.owned)
            case M.UnloadAdapter():
                return self.unload_lora_adapter(cmd.name)
            case M.GetSnapshot():
                return self.snapshot()
            case M.CheckInvariants():
                return self.check_invariants()
        raise TypeError(f"unknown engine command {cmd!r}")

    def shutdown(self) -> None:
        self.store.shutdown()
