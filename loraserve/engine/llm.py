"""The offline API: `LLM(...).generate(prompts, SamplingParams(...), lora=[...])`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from loraserve.adapters.spill import spill_dir
from loraserve.config import EngineConfig
from loraserve.types import RequestOutput, SamplingParams

Prompt = str | list[int] | list[dict]


class LLM:
    def __init__(self, model: str | Path | None = None, *,
                 lora_paths: dict[str, str] | None = None, **engine_kwargs):
        from loraserve.engine.engine import LLMEngine

        self.config = EngineConfig(**engine_kwargs)
        self.engine = LLMEngine(model, self.config)
        for name, path in (lora_paths or {}).items():
            self.engine.load_lora_adapter(name, path)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def load_lora_adapter(self, name: str, path: str | Path | None = None, pinned: bool = False,
                          *, tensors: Mapping[str, torch.Tensor] | None = None, config=None,
                          replace: bool = False) -> int:
        """Load a PEFT adapter from its directory, or from memory: `tensors` in PEFT's
        state-dict names (`peft.get_peft_model_state_dict(model)`) and `config`
        (adapter_config.json's contents, or the PEFT `LoraConfig`). `replace`: a new version
        of a loaded name; requests already running finish on the version they started with.
        Returns the version now serving under `name` (`name@N`)."""
        if (path is None) == (tensors is None):
            raise ValueError("give either a path or tensors (with their config)")
        if tensors is None:
            return self.engine.load_lora_adapter(name, path, pinned=pinned, replace=replace)
        if config is None:
            raise ValueError("tensors need their config (adapter_config.json's contents)")
        self.engine.store.check_new(name, "", pinned, replace)  # before writing anything
        copy = spill_dir().write(name, tensors, config)
        try:
            return self.engine.load_lora_adapter(name, copy, pinned=pinned, replace=replace,
                                                 owned=True)
        except BaseException:
            spill_dir().remove(copy)
            raise

    def unload_lora_adapter(self, name: str) -> None:
        """Unload `name` (every version of it) or one version, `name@N`."""
        self.engine.unload_lora_adapter(name)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora: str | None | Sequence[str | None] = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int | dict)):
            prompts = [prompts]
        n = len(prompts)
        params = sampling_params or SamplingParams()
        params = [params] * n if isinstance(params, SamplingParams) else list(params)
        loras = [lora] * n if lora is None or isinstance(lora, str) else list(lora)
        if len(params) != n or len(loras) != n:
            raise ValueError("sampling_params and lora need one entry per prompt")
        # Validate everything before queueing anything: a bad prompt queues nothing.
        ids = [self.engine.tokenize(p) for p in prompts]
        reqs = []
        try:
            for p, sp, name in zip(ids, params, loras, strict=True):
                reqs.append(self.engine.add_request(p, sp, lora_name=name))
        except Exception:
            for r in reqs:
                self.engine.abort(r.request_id)
            raise
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=n, desc="generate", disable=not use_tqdm)
        while len(results) < n:
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [results[r.request_id] for r in reqs]

    def chat(self, conversations: list[list[dict]] | list[dict],
             sampling_params: SamplingParams | None = None,
             lora: str | None | Sequence[str | None] = None) -> list[RequestOutput]:
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self.generate(list(conversations), sampling_params, lora)
