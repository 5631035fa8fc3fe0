"""A tiny mixture-of-experts model's step time against transformers on the same batch.

A random Qwen3-MoE-shaped checkpoint (4 layers, hidden 512, 16 experts of 384, top 4, the
bundled model's vocabulary and tokenizer; nothing downloaded) and one PEFT adapter with LoRA on
every expert (target_parameters) and q_proj, rank 16. One batch: B prompts of L tokens, then D
greedy decode steps. Measured per round, alternating the order every round:

- loraserve, base rows only: its prefill step (the whole batch in one step) and the median of
  its decode steps (`StepTimes`);
- loraserve, half the rows on the expert adapter, half base (mixed in the same steps);
- transformers: one forward of the [B, L] batch (logits of the last position only, as ours)
  and the median of D single-token forwards over its KV cache.

The figures are medians over rounds; ratios are transformers' time over ours.

    .venv/bin/python benchmarks/moe_step.py [--rounds 5] [--batch 8] [--prompt 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import StepTimes, random_prompts, scratch_dir, time_ours, write_result  # noqa: E402

from loraserve import LLM  # noqa: E402
from loraserve.model.bundled import default_model_dir  # noqa: E402

SHAPES = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=4, head_dim=64, num_experts=16, num_experts_per_tok=4,
              moe_intermediate_size=384, intermediate_size=1024, norm_topk_prob=True,
              vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=False)


def make_model(out: Path) -> tuple[Path, Path]:
    """The checkpoint (with the bundled tokenizer) and the expert adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("qwen3_moe", **SHAPES, bos_token_id=1, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(out / "model")
    for f in default_model_dir().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / "model" / f.name)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj"],
                      target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    peft = get_peft_model(model, lora)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, m in sorted(peft.named_modules(), key=lambda kv: kv[0]):
            if hasattr(m, "lora_A") and "default" in m.lora_A:
                for w in (m.lora_A["default"].weight, m.lora_B["default"].weight):
                    w.copy_(torch.randn(w.shape, generator=g) * 0.05)
    peft.save_pretrained(out / "adapter")
    return out / "model", out / "adapter"


def time_transformers(model, prompts: list[list[int]], decode: int) -> tuple[float, float]:
    """(prefill seconds, median decode-step seconds) of one batch through transformers."""
    from transformers import DynamicCache

    ids = torch.tensor(prompts)
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        t = time.perf_counter()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        prefill = time.perf_counter() - t
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        steps = []
        for _ in range(decode):
            t = time.perf_counter()
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            steps.append(time.perf_counter() - t)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    return prefill, statistics.median(steps)


def time_loraserve(llm, steps: StepTimes, prompts, decode: int, loras) -> tuple[float, float]:
    """(prefill step seconds, median decode-step seconds); the adapter is resident by then
    (the warm-up loaded it), so the whole batch prefills in one step."""
    steps.clear()
    time_ours(llm, prompts, decode + 1, loras)  # the prefill step samples the first token
    pre = [s for p, s in steps.steps if p]
    dec = [s for p, s in steps.steps if not p]
    return sum(pre) / len(pre), statistics.median(dec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads for both (default: torch's own)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM

    model_dir, adapter = make_model(scratch_dir("moe-step-"))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(str(model_dir), lora_paths={"experts": str(adapter)},
              max_num_batched_tokens=a.batch * a.prompt, max_num_seqs=a.batch)
    prompts = random_prompts(a.batch, a.prompt, SHAPES["vocab_size"])
    mixed = ["experts" if i % 2 else None for i in range(a.batch)]
    steps = StepTimes()
    runs = {
        "transformers": lambda: time_transformers(hf, prompts, a.decode),
        "loraserve_base": lambda: time_loraserve(llm, steps, prompts, a.decode, None),
        "loraserve_mixed_expert_lora": lambda: time_loraserve(llm, steps, prompts, a.decode,
                                                              mixed),
    }
    for fn in runs.values():  # warm-up: loads the adapter into a slot
        fn()
    steps.clear()
    time_ours(llm, prompts, 2, mixed)
    assert sum(p for p, _ in steps.steps) == 1, "the mixed batch's prefill is not one step"
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
    for r in range(a.rounds):
        for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            times[name].append(runs[name]())
    med = {k: {"prefill_ms": 1e3 * statistics.median(p for p, _ in v),
               "decode_step_ms": 1e3 * statistics.median(d for _, d in v)}
           for k, v in times.items()}
    hf_t, ours = med["transformers"], med["loraserve_base"]
    ratios = {"transformers_over_loraserve_prefill": hf_t["prefill_ms"] / ours["prefill_ms"],
              "transformers_over_loraserve_decode": hf_t["decode_step_ms"] /
              ours["decode_step_ms"],
              "mixed_lora_over_base_prefill": med["loraserve_mixed_expert_lora"]["prefill_ms"] /
              ours["prefill_ms"],
              "mixed_lora_over_base_decode":
              med["loraserve_mixed_expert_lora"]["decode_step_ms"] / ours["decode_step_ms"]}
    for k, v in med.items():
        print(f"{k:30s} prefill {v['prefill_ms']:8.1f} ms  decode step "
              f"{v['decode_step_ms']:7.2f} ms")
    for k, v in ratios.items():
        print(f"{k:40s} {v:.2f}")
    path = write_result("moe_step", {"shapes": SHAPES, "batch": a.batch, "prompt": a.prompt,
                                     "decode": a.decode, "rounds": a.rounds,
                                     "threads": torch.get_num_threads(),
                                     "medians": med, "ratios": ratios,
                                     "raw": {k: v for k, v in times.items()}})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
