"""The engine core: one step = schedule, bind adapters to slots, run the model, process tokens.

Single-threaded by design: whoever calls `step()` owns the scheduler, the KV pool and the
adapter store. The server runs it on its own thread (engine/async_engine.py).
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path

import torch

from loraserve.config import EngineConfig
from loraserve.engine.output import check_stop, to_output
from loraserve.engine.runner import ModelRunner
from loraserve.kvcache.manager import KVCacheManager
from loraserve.model.bundled import resolve_model_path
from loraserve.model.loader import load_model
from loraserve.model.tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer
from loraserve.request import Request, RequestStatus
from loraserve.scheduler.scheduler import Scheduler
from loraserve.types import (
    AdapterNotFoundError,
    FinishReason,
    RequestOutput,
    RequestTooLargeError,
    SamplingParams,
)

log = logging.getLogger("loraserve.engine")


class LLMEngine:
    def __init__(self, model: str | Path | None = None, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model_path = resolve_model_path(model)
        self.model = load_model(self.model_path)
        self.model_config = self.model.config
        self.model_name = self.model_config.name
        self.tokenizer = Tokenizer(self.model_path)
        self.eos_ids = set(self.tokenizer.eos_token_ids) | set(self.model_config.eos_token_ids)
        self.max_model_len = min(config.max_model_len or 10**9,
                                 self.model_config.max_position_embeddings)
        num_blocks = config.kv_cache_tokens // config.block_size
        self.kv = KVCacheManager(num_blocks, config.block_size)
        self.runner = ModelRunner(self.model, config, num_blocks)
        self.adapters = None  # the adapter store, when LoRA is enabled (engine/lora_engine.py)
        self.scheduler = Scheduler(config, self.kv, gate=None)
        self.requests: dict[str, Request] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._detok: dict[str, tuple[IncrementalDetokenizer, StopChecker]] = {}
        self._ids = itertools.count()
        self.num_steps = 0

    # --- requests ---------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int] | list[dict]) -> list[int]:
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

    def resolve_adapter(self, lora_name: str | None) -> int | None:
        """Name -> uid, once, at admission. Overridden when adapters are enabled."""
        if lora_name is None:
            return None
        raise AdapterNotFoundError(f"adapter {lora_name!r} is not loaded (no adapters enabled)")

    def add_request(self, prompt: str | list[int] | list[dict], params: SamplingParams,
                    lora_name: str | None = None, request_id: str | None = None) -> Request:
        ids = self.tokenize(prompt)
        if not ids:
            raise RequestTooLargeError("the prompt is empty")
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
        uid = self.resolve_adapter(lora_name)  # acquires the adapter's refcount
        req = Request(request_id, ids, params, adapter_uid=uid, lora_name=lora_name)
        if params.seed is not None:
            self._generators[request_id] = torch.Generator().manual_seed(params.seed)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        return self._finish(req, FinishReason.ABORT)

    def _finish(self, req: Request, reason: FinishReason, error: str | None = None):
        """The one place a request ends: blocks and the adapter refcount come back here."""
        if req.is_finished:
            return to_output(req)
        self.scheduler.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.error = error
        self.requests.pop(req.request_id, None)
        self._generators.pop(req.request_id, None)
        self._detok.pop(req.request_id, None)
        self._release_adapter(req)
        return to_output(req)

    def _release_adapter(self, req: Request) -> None:
        pass  # no adapters in the base engine

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # --- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        batch = self.scheduler.schedule()
        for req, why in batch.failed:
            outputs.append(self._finish(req, FinishReason.ERROR, why))
        if not batch:
            return outputs
        self.num_steps += 1
        self._bind(batch.adapter_uids)
        sampled = self.runner.execute(batch.entries, self._slot_of, self._generators,
                                      self._lora_factory())
        for req, n in batch.entries:
            req.num_computed_tokens += n
        for req, token, lp, top in sampled:
            self._append_token(req, token, lp, top)
            if req.finish_reason is not None:
                outputs.append(self._finish(req, req.finish_reason))
            else:
                outputs.append(to_output(req))
        return outputs

    def _bind(self, uids: set[int]) -> None:
        pass  # no adapters in the base engine

    def _slot_of(self, req: Request) -> int:
        return -1

    def _lora_factory(self):
        return None

    def _append_token(self, req: Request, token: int, lp, top) -> None:
        req.output_token_ids.append(token)
        if lp is not None:
            req.logprobs.append(lp)
            if top is not None:
                req.top_logprobs.append(top)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        check_stop(req, token, self.eos_ids, self.max_model_len)
        detok, stops = self._detok.get(req.request_id) or self._new_detok(req)
        stop_token = req.finish_reason is FinishReason.STOP  # EOS or a stop id: not text
        prev = len(req.text)
        if not stop_token:
            req.text += detok.add(token)
        if req.finish_reason is not None:
            req.text += detok.flush()  # whatever was held back for a partial character
        if stops and len(req.text) > prev:
            cut = stops.find(req.text, len(req.text) - prev)
            if cut is not None:
                req.text = req.text[:cut]
                req.finish_reason = FinishReason.STOP
            else:
                req.holdback = stops.holdback(req.text)
        if req.finish_reason is not None:
            req.holdback = 0
            self._detok.pop(req.request_id, None)

    def _new_detok(self, req: Request):
        pair = (IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids),
                StopChecker(req.params.stop))
        self._detok[req.request_id] = pair
        return pair
