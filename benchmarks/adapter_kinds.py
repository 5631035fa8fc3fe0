"""What a DoRA adapter and an embedding + lm_head adapter cost in a mixed batch, against a
plain LoRA adapter of the same rank, on the bundled model, side by side in one run.

Three PEFT adapters (rank 16 on all seven modules, random weights): `plain`; `dora` (the same
with use_dora: a per-column scale on its rows after every projection); `vocab` (the same plus
LoRA on embed_tokens and lm_head: a lookup and a [V, r] expand on its rows). Each run is one
`generate` of 16 base + 16 adapter requests (64 tokens in, 32 out, greedy, ignore EOS) in one
batch. Runs alternate plain, dora, plain, vocab, ... (A/B, each pair's order swapped every
round), and each ratio is the median over rounds of the kind's time over its pair's plain
time, so the machine's drift cancels.

    .venv/bin/python benchmarks/adapter_kinds.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    StepTimes,
    median,
    random_prompts,
    scratch_dir,
    time_ours,
    write_result,
)

from loraserve import LLM  # noqa: E402
from loraserve.config import LORA_MODULES  # noqa: E402
from loraserve.model.bundled import default_model_dir  # noqa: E402

KINDS = {
    "plain": dict(target_modules=list(LORA_MODULES)),
    "dora": dict(target_modules=list(LORA_MODULES), use_dora=True),
    "vocab": dict(target_modules=[*LORA_MODULES, "embed_tokens", "lm_head"]),
}


def make_adapters(model_dir: Path, out: Path, rank: int) -> dict[str, str]:
    """PEFT-saved adapters of each kind with random A and B (and embedding LoRA), seeded."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = {}
    for i, (name, kw) in enumerate(KINDS.items()):
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, **kw))
        gen = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_" in pname and "magnitude" not in pname:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        paths[name] = str(out / name)
        model.save_pretrained(paths[name])
        del model, base
    return paths


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--requests", type=int, default=16, help="adapter rows (and base rows)")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--out-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's; 1 on a host shared with other jobs)")
    args = ap.parse_args()

    model_dir = default_model_dir()
    paths = make_adapters(model_dir, scratch_dir("adapter_kinds_"), args.rank)
    llm = LLM(model_dir, lora_paths=paths, max_lora_rank=args.rank,
              enable_prefix_caching=False, num_threads=args.threads)
    n = args.requests
    prompts = random_prompts(2 * n, args.input_len, llm.engine.model_config.vocab_size)
    steps = StepTimes()

    def run(kind: str) -> tuple[float, float, float]:
        steps.clear()
        total = time_ours(llm, prompts, args.out_len, [kind] * n + [None] * n)
        return (total, *steps.split())

    for kind in KINDS:  # warm-up: every adapter resident, first-touch costs paid
        run(kind)
    times: dict[str, list[tuple[float, float, float]]] = {k: [] for k in KINDS}
    for i in range(args.rounds):
        for kind in ("dora", "vocab"):
            # each pair's order alternates, so a warm or cold first run favours neither side
            first, second = ("plain", kind) if i % 2 == 0 else (kind, "plain")
            times[first].append(run(first))
            times[second].append(run(second))
            print(f"round {i}: plain {times['plain'][-1][0]:.3f}s, {kind} "
                  f"{times[kind][-1][0]:.3f}s", flush=True)
    result = {"rank": args.rank, "requests": f"{n} adapter + {n} base rows",
              "input_len": args.input_len, "out_len": args.out_len, "rounds": args.rounds}
    for kind in ("dora", "vocab"):
        plain = times["plain"][0::2] if kind == "dora" else times["plain"][1::2]
        for i, part in enumerate(("total", "prefill", "decode")):
            result[f"{kind}_vs_plain_{part}"] = round(median(
                [k[i] / p[i] for k, p in zip(times[kind], plain, strict=True)]), 3)
        result[f"{kind}_total_s"] = round(median([t[0] for t in times[kind]]), 3)
    result["plain_total_s"] = round(median([t[0] for t in times["plain"]]), 3)
    print(write_result("adapter_kinds", result))
    for k, v in result.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
