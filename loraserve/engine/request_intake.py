"""A request's way into the engine: its prompt tokenized and checked against the model's
context and the KV cache, its grammar compiled, its adapter name bound to a uid (refcount +1)
and its fork parent found, then queued. Mixed into `LLMEngine` (engine/engine.py), whose
state it uses on the engine thread."""

from __future__ import annotations

import torch

from loraserve.engine import messages as M
from loraserve.kvcache.prefix_hash import BASE_NAMESPACE, adapter_namespace
from loraserve.model.structured import CompiledGrammar
from loraserve.request import Request
from loraserve.types import LoraServeError, RequestTooLargeError, SamplingParams


class RequestIntake:
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
                    client_id: str | None = None,
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
        if parent is not None and (parent.prompt_token_ids != ids or parent.adapter_uid != uid
                                   or params.prompt_logprobs is not None):
            # not the same prompt under the same weights, or its prompt's logits are wanted
            parent = None
        req = Request(request_id, ids, params, adapter_uid=uid, lora_name=lora_name,
                      generator=gen, origin=origin, client_id=client_id,
                      cache_namespace=namespace, fork_parent=parent,
                      grammar=None if grammar is None else grammar.new_matcher())
        if uid is not None:  # the version it is bound to, for its outputs
            req.adapter_version = self.store.version(uid)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req
