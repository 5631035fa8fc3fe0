"""Test helper: the transformers + PEFT reference for LoRA outputs, and engine checks.

The reference for a LoRA request is a float32 `PeftModel` holding only that adapter, run on
that prompt alone with greedy decoding that never stops early (docs/design.md §4).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from adapter_factory import load_base_model, make_peft_adapter

from loraserve.config import ATTN_MODULES, LORA_MODULES
from loraserve.types import SamplingParams

_MODELS: dict[tuple, torch.nn.Module] = {}

# Small adapters for lifecycle tests: a and b alike but different weights; x targets all seven
# modules at rank 4 and y only q_proj at rank 16 (so y's packed rank rows cover x's k/v).
LIFECYCLE_ADAPTERS = {
    "a": dict(r=8, lora_alpha=16, target_modules=ATTN_MODULES, seed=1),
    "b": dict(r=8, lora_alpha=16, target_modules=ATTN_MODULES, seed=2),
    "c": dict(r=16, lora_alpha=16, target_modules=LORA_MODULES, seed=3),
    "x": dict(r=4, lora_alpha=8, target_modules=LORA_MODULES, seed=4, init_scale=1.0),
    "y": dict(r=16, lora_alpha=16, target_modules=["q_proj"], seed=5, init_scale=1.0),
}


def make_adapters(base_dir: Path, root: Path, specs: dict[str, dict] | None = None):
    specs = LIFECYCLE_ADAPTERS if specs is None else specs
    return {n: make_peft_adapter(base_dir, root / n, **s) for n, s in specs.items()}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def assert_interleaved_batch_matches(llm, prompts: dict, refs: dict, max_tokens: int,
                                     label: tuple = ()) -> None:
    """Every prompt of `prompts` ({adapter or None: [prompt, ...]}) in one greedy `generate`,
    adapters and base rows shuffled together in the batch; each row's tokens must equal
    `refs[(adapter, index)]`."""
    keys = [(g, i) for g, ps in prompts.items() for i in range(len(ps))]
    random.Random(0).shuffle(keys)
    outs = llm.generate([prompts[g][i] for g, i in keys], greedy(max_tokens),
                        lora=[g for g, _ in keys])
    for key, out in zip(keys, outs, strict=True):
        assert out.error is None, out.error
        assert out.token_ids == refs[key], (*label, key)


def argmax_loop(model, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens by recomputing the whole sequence each step (no cache, no processors:
    HF's generate masks EOS under min_new_tokens, this does nothing of the kind)."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    """HF greedy continuation of one unpadded prompt (a PeftModel or a plain model)."""
    from transformers import GenerationConfig

    gc = GenerationConfig(do_sample=False, max_new_tokens=max_new, eos_token_id=[],
                          pad_token_id=0)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             generation_config=gc)
    return out[0, len(prompt):].tolist()


def peft_greedy(base_dir: Path, adapter: Path | None, prompt: list[int], n: int) -> list[int]:
    """PEFT greedy tokens of `prompt` with the adapter saved at `adapter` as it is on disk now
    (None: the base model). Models are cached by path and weight bytes."""
    from peft import PeftModel

    key = (str(base_dir), None if adapter is None else
           (str(adapter), (Path(adapter) / "adapter_model.safetensors").read_bytes()))
    if key not in _MODELS:
        base = load_base_model(base_dir)
        _MODELS[key] = base if adapter is None else PeftModel.from_pretrained(base, adapter)
    return hf_greedy(_MODELS[key], prompt, n)


def prompt_logprobs(model, prompt: list[int], k: int) -> list[tuple[float, int, list]]:
    """The reference scores of a prompt: per token after the first, (its logprob, its rank,
    the top-k (token id, logprob)) from the HF/PEFT model's float32 log-softmax."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt])).logits[0].float()
    logp = logits.log_softmax(-1)
    out = []
    for p in range(1, len(prompt)):
        vals, idx = torch.topk(logp[p - 1], k)
        lp = logp[p - 1, prompt[p]]
        rank = int((logp[p - 1] > lp).sum()) + 1
        out.append((lp.item(), rank, list(zip(idx.tolist(), vals.tolist(), strict=True))))
    return out


def run_until_done(eng, outs: dict | None = None, max_steps: int = 500) -> dict:
    """Step the engine until it is idle; finished outputs by request id."""
    outs = {} if outs is None else outs
    for _ in range(max_steps):
        if not eng.has_work:
            return outs
        outs.update({o.request_id: o for o in eng.step() if o.finished})
        eng.check_invariants().raise_if_failed()  # between any two steps, every one holds
    raise AssertionError("the engine did not drain")


def assert_idle(eng) -> None:
    """Nothing queued, every KV block free, every adapter refcount back to zero."""
    assert not eng.has_work and not eng.requests
    assert eng.kv.pool.num_free == eng.kv.pool.num_blocks, "KV blocks leaked"
    assert all(e.refcount == 0 for e in eng.store.entries.values()), "refcount leaked"
    eng.check_invariants().raise_if_failed()


# Prompts shared by the lifecycle and slot tests (token ids of the tiny model's vocabulary).
P1, P2, P3, P4 = [5, 77, 301, 12, 9], [400, 23, 8, 150, 66, 42, 7, 310, 99], [260], [31, 17, 480]


def gen(llm, prompts, loras, n: int = 6) -> list[list[int]]:
    """Greedy token ids of an offline `generate`; fails if any request errored."""
    outs = llm.generate(prompts, greedy(n), lora=loras)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs]


def entry(llm, name: str):
    """The AdapterStore entry registered under `name`."""
    store = llm.engine.store
    return store.entries[store.names[name]]

