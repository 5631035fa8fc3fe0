"""The engine: one base model, its adapters, and a step that runs every kind of batch.

Single-threaded by design: whoever calls `step()` (and the commands below) owns the
scheduler, the KV pool and the adapter store. The server runs it on its own thread
(engine/async_engine.py) and talks to it only through engine/messages.py.
"""

from __future__ import annotations

import itertools
import logging
import os
from pathlib import Path

import torch

from loraserve.adapters.disk_loader import DiskLoader
from loraserve.adapters.format import LoraAdapterWeights, read_adapter
from loraserve.adapters.slot_pool import LoraSlotPool
from loraserve.adapters.stats import AdapterStats
from loraserve.adapters.store import AdapterStore
from loraserve.config import EngineConfig
from loraserve.engine import messages as M
from loraserve.engine.device import resolve_device
from loraserve.engine.invariants import InvariantReport, check_engine
from loraserve.engine.kv_sizing import size_kv_cache
from loraserve.engine.output_processor import OutputProcessor, to_output
from loraserve.engine.runner import ModelRunner
from loraserve.kvcache.manager import KVCacheManager
from loraserve.kvcache.prefix_hash import BASE_NAMESPACE, adapter_namespace
from loraserve.lora.backends import create_lora_backend, pool_tile_width
from loraserve.model.attention import create_attention_backend
from loraserve.model.bundled import resolve_model_path
from loraserve.model.loader import load_model
from loraserve.model.structured import CompiledGrammar, GrammarCompiler
from loraserve.model.tokenizer import Tokenizer
from loraserve.ops.native_memory import MemoryTrimmer
from loraserve.request import Request
from loraserve.scheduler.batch import ScheduledBatch, StepOutput
from loraserve.scheduler.scheduler import Scheduler
from loraserve.types import (
    FinishReason,
    LoraServeError,
    RequestOutput,
    RequestTooLargeError,
    SamplingParams,
)

log = logging.getLogger("loraserve.engine")


class LLMEngine:
    def __init__(self, model: str | Path | None = None, config: EngineConfig | None = None,
                 device: str | torch.device | None = None):
        self.config = c = config or EngineConfig()
        if c.num_threads:
            torch.set_num_threads(c.num_threads)
        self.device, self.dtype = resolve_device(device or c.device, c.dtype)
        self.model_path = resolve_model_path(model)
        self.model = load_model(self.model_path, self.dtype, self.device)
        self.model_config = mc = self.model.config
        self.tokenizer = Tokenizer(self.model_path)
        self.max_model_len = min(c.max_model_len or 10**9, mc.max_position_embeddings)
        unified = c.lora_memory == "unified" or (c.lora_memory == "auto"
                                                 and self.device.type == "cpu")
        # unified: the pool grows as adapters arrive (store._settle), from a few slots
        first = min(4, c.max_loaded_loras or 4) if unified else c.num_lora_slots
        lora_dtype = self.dtype if c.lora_dtype == "auto" else c.lora_torch_dtype
        lora_name = c.lora_backend or (None if self.device.type == "cpu" else "triton")
        self.slot_pool = LoraSlotPool(
            mc, first, c.max_lora_rank, dtype=lora_dtype, device=self.device,
            tile_width=pool_tile_width(lora_name, lora_dtype, self.device))
        # after the weights and the slot pool: on a GPU the cache gets what they leave
        self.kv_sizing = size_kv_cache(c, mc, self.device, self.dtype)
        num_blocks = self.kv_sizing.tokens // c.block_size
        # decode graphs' padding rows write to a block of their own, within the budget
        graphs = self.device.type == "cuda" and not c.disable_cuda_graph and num_blocks > 1
        num_blocks -= graphs
        self.kv = KVCacheManager(num_blocks, c.block_size, c.enable_prefix_caching)
        self.store = AdapterStore(self.slot_pool, DiskLoader(self.read_adapter),
                                  max_loras_per_batch=c.max_loras_per_batch,
                                  max_loaded_loras=c.max_loaded_loras,
                                  max_loras_prefetch=c.max_loras_prefetch,
                                  reserved_names=frozenset({mc.name}), unified=unified,
                                  unified_prefetch=c.unified_prefetch)
        lora = create_lora_backend(self.slot_pool, lora_name)
        default_attention = "cpu" if self.device.type == "cpu" else "triton"
        attention = create_attention_backend(c.attention_backend or default_attention,
                                             c.block_size, self.device)
        eos = frozenset(self.tokenizer.eos_token_ids) | frozenset(mc.eos_token_ids)
        self.runner = ModelRunner(self.model, c, num_blocks, self.device, attention, lora, eos,
                                  scratch_block=graphs)
        if graphs:
            try:
                self.runner.enable_decode_graphs(min(c.cuda_graph_max_bs, c.max_num_seqs),
                                                 self.max_model_len)
            except ValueError as e:  # a non-Triton backend was asked for
                log.warning("decode steps run eagerly: %s", e)
        self.scheduler = Scheduler(c, self.kv, self.store, eos, self.max_model_len)
        # adapters change no token embedding, so every route shares the base's grammars
        self.grammars = GrammarCompiler(self.tokenizer.hf, mc.vocab_size, eos)
        self.output_processor = OutputProcessor(self.tokenizer)
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

    # --- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched, store = self.scheduler, self.store
        load_errors = store.prepare(sched.running_adapters(), sched.waiting_adapters())
        ended = sched.fail_waiting(load_errors)
        batch = sched.schedule()
        self._count_prefix_hits(batch.admitted)
        sampled = []
        if batch:
            self.num_steps += 1
            self.runner.copy_blocks(batch.block_copies)  # forks' copies of a partial block
            output, broken = self._execute(batch, store.bind(batch.adapter_uids))
            ended += broken
            sampled = sched.update_from_output(batch, output)
            ended += sched.end_without_token(batch, output)
            for req in self.output_processor.process(sampled):  # ended by a stop string
                sched.finish(req, FinishReason.STOP)
        elif sched.waiting and not sched.running:
            store.wait_for_loads(timeout=0.05)  # only an adapter load can make progress
        self.trimmer.maybe_trim()
        return [self._output(r) for r in ended + sampled]

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

    # --- requests ---------------------------------------------------------------------------
    def tokenize(self, prompt: M.Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if prompt and isinstance(prompt[0], dict):
            return self.tokenizer.apply_chat_template(prompt)
        ids = [int(t) for t in prompt]
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestTooLargeError(f"token ids out of range [0, {vocab}): {bad[:5]}")
        return ids

    def add_request(self, prompt: M.Prompt, params: SamplingParams,
                    lora_name: str | None = None, request_id: str | None = None,
                    origin: str | None = None, fork_of: str | None = None,
                    grammar: CompiledGrammar | None = None) -> Request:
        """`grammar`: params.structured_outputs compiled off this thread (the server does);
        None compiles it here."""
        ids = self.tokenize(prompt)
        if not ids:
            raise RequestTooLargeError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if params.logit_bias and params.logit_bias[-1][0] >= vocab:  # sorted by token id
            raise LoraServeError(f"logit_bias: token {params.logit_bias[-1][0]} is outside "
                                 f"the vocabulary [0, {vocab})")
        total = len(ids) + params.max_tokens
        if len(ids) >= self.max_model_len:
            raise RequestTooLargeError(
                f"prompt has {len(ids)} tokens; the model's context is {self.max_model_len}")
        if total > self.kv.capacity_tokens:
            raise RequestTooLargeError(
                f"prompt ({len(ids)}) + max_tokens ({params.max_tokens}) = {total} tokens can "
                f"never fit the KV cache ({self.kv.capacity_tokens} tokens)")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        if params.structured_outputs is not None and grammar is None:
            grammar = self.grammars.compile(params.structured_outputs)
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
        # Name -> uid once, here; acquires the refcount (404 for a name never loaded).
        uid = None if lora_name is None else self.store.acquire(lora_name)
        namespace = BASE_NAMESPACE if uid is None else \
            adapter_namespace(self.store.fingerprint(uid))
        parent = self.requests.get(fork_of) if fork_of is not None else None
        if parent is not None and (parent.prompt_token_ids != ids or parent.adapter_uid != uid):
            parent = None  # not the same prompt under the same weights: nothing to share
        req = Request(request_id, ids, params, adapter_uid=uid, lora_name=lora_name,
                      generator=gen, origin=origin, cache_namespace=namespace,
                      fork_parent=parent,
                      grammar=None if grammar is None else grammar.new_matcher())
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        for fork in list(req.forks):  # its forks go with it
            self.abort(fork.request_id)
        self.scheduler.finish(req, FinishReason.ABORT)
        return self._output(req)

    # --- adapters (between steps) -----------------------------------------------------------
    def read_adapter(self, path: str | os.PathLike) -> LoraAdapterWeights:
        """Read and fully validate an adapter (any thread; touches no engine state)."""
        return read_adapter(path, self.model_config, max_lora_rank=self.config.max_lora_rank,
                            allow_pickle=self.config.allow_pickle_adapters)

    def load_lora_adapter(self, name: str, path: str | os.PathLike, pinned: bool = False,
                          weights: LoraAdapterWeights | None = None) -> None:
        """Register `name`. `weights` may be pre-read off-thread; else it is read here."""
        path = str(path)
        if weights is None and not self.store.check_new(name, path, pinned):
            weights = self.read_adapter(path)
        self.store.register(name, path, weights, pinned,
                            in_use=self.scheduler.running_adapters())

    def unload_lora_adapter(self, name: str) -> None:
        self.store.unregister(name)

    def snapshot(self) -> M.EngineSnapshot:
        pool = self.kv.pool
        return M.EngineSnapshot(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            kv_blocks_used=pool.num_used, kv_blocks_total=pool.num_blocks,
            num_steps=self.num_steps, adapters=self.store.snapshot(),
            model_name=self.info.model_name, base_prefix_queries=self.base_prefix.prefix_queries,
            base_prefix_hits=self.base_prefix.prefix_hits, kv_blocks_cached=pool.num_cached)

    def check_invariants(self, awaited: tuple[str, ...] = ()) -> InvariantReport:
        """Every KV block, adapter refcount, slot and load accounted for (engine/invariants.py);
        call between steps. `.raise_if_failed()` turns violations into an InvariantError."""
        return check_engine(self, awaited)

    def handle(self, cmd: M.EngineCommand):
        """Apply one command between steps; its reply (or the exception it raised)."""
        match cmd:
            case M.AddRequest():
                return self.add_request(cmd.prompt, cmd.params, cmd.lora_name, cmd.request_id,
                                        cmd.origin, cmd.fork_of, cmd.grammar)
            case M.AbortRequest():
                return self.abort(cmd.request_id)
            case M.CheckAdapterLoad():
                return self.store.check_new(cmd.name, cmd.path, cmd.pinned)
            case M.LoadAdapter():
                return self.load_lora_adapter(cmd.name, cmd.path, cmd.pinned, cmd.weights)
            case M.UnloadAdapter():
                return self.unload_lora_adapter(cmd.name)
            case M.GetSnapshot():
                return self.snapshot()
            case M.CheckInvariants():
                return self.check_invariants()
        raise TypeError(f"unknown engine command {cmd!r}")

    def shutdown(self) -> None:
        self.store.shutdown()
