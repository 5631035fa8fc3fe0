"""The Triton kernels' program shapes on a GPU, each candidate timed in one process: which
column strips, rank step and part of d_in the LoRA kernels run fastest with in a replayed
mixed decode step, which rows per program in a prompt step, and which context tile the
paged-attention kernel runs fastest with in a base-only decode step (batch-1 time per token
beside it). Optionally another triton_sgmv.py (an earlier version) at its own defaults in the
same mixed step.

Each candidate is a spec for common.set_kernel_shapes ("" = the defaults), set on top of the
defaults, graphs recorded again for each. The device time of the family's kernels (torch
profiler) decides; `best` joins each family's fastest into one spec, which gpu_check.sh hands
to gpu_serving.py and gpu_churn.py (`--kernel-shapes`).

One engine on the Llama-3.2-1B-shaped model of gpu_serving.py (bf16, random weights), 16
adapters r8-64 on all modules, 64 sequences.

    PYTHONPATH=. python benchmarks/gpu_kernel_shapes.py [--json FILE]   # on the GPU machine
    TRITON_INTERPRET=1 .venv/bin/python benchmarks/gpu_kernel_shapes.py --smoke  # the script
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import set_kernel_shapes  # noqa: E402
from gpu_decode_step import (  # noqa: E402
    mixed_engine,
    per_token_ms,
    profile_mixed_step,
    profiled,
)

from loraserve import LLM, SamplingParams  # noqa: E402
from loraserve.engine.cuda_graphs import ReplayEmulator  # noqa: E402

FAMILIES = {  # family: (candidates, kernel-name prefix, what is timed)
    "lora_decode": (("", "lora.EXPAND_STRIPS=2", "lora.EXPAND_STRIPS=4", "lora.K_CHUNK=512",
                     "lora.EXPAND_STRIPS=2,lora.K_CHUNK=2048"), "sgmv_", "mixed"),
    "lora_prompt": (("", "lora.LONG_BLOCK_M=16"), "sgmv_", "prompt"),
    "attention": (("", "attention.BLOCK_N=32", "attention.BLOCK_N=64"), "paged_attention",
                  "base"),
}


def load_kernels(path: str):
    """The Triton LoRA kernels from another source file (an earlier version, to compare in
    the same process); launchers that take fewer arguments than ours get the first ones."""
    spec = importlib.util.spec_from_file_location("lora_kernels_" + Path(path).stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    expand, shrink = mod.launch_expand, mod.launch_shrink
    n_expand = len(inspect.signature(expand).parameters)
    n_shrink = len(inspect.signature(shrink).parameters)
    mod.launch_expand = lambda *args: expand(*args[:n_expand])
    mod.launch_shrink = lambda *args: shrink(*args[:n_shrink])
    if not hasattr(mod, "rows_per_program"):
        mod.rows_per_program = lambda lengths: mod.BLOCK_M
    return mod


def profile_prompts(llm: LLM, names: list[str], prompts: int, length: int) -> dict:
    """Per prompt step: `prompts` prompts of `length` tokens over the adapters `names`, run
    until each has its first token (eager steps)."""
    eng = llm.engine
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    steps: list[int] = []  # engine steps of each run

    def run() -> None:
        reqs = [eng.add_request(list(range(300 + i, 300 + i + length)), params,
                                names[i % len(names)]) for i in range(prompts)]
        steps.append(0)
        while not all(r.output_token_ids for r in reqs):
            eng.step()
            steps[-1] += 1

    run()  # compiles what the profiled run needs
    res = profiled(run, 1, eng.device.type)
    res["steps"] = steps[-1]
    return res


def time_candidate(llm: LLM, what: str, names: list[str], seqs: int, prompt: list[int]
                   ) -> dict:
    """One candidate's run: a replayed mixed or base-only decode step of `seqs` sequences,
    or the prompt steps of `seqs` // 4 prompts of 128 tokens (16 of 2048 tokens at 64)."""
    if what == "prompt":
        return profile_prompts(llm, names, max(1, seqs // 4), 128 if seqs >= 64 else 16)
    res = profile_mixed_step(llm, names if what == "mixed" else [None], seqs, 8)
    if what == "base":
        res["batch1_ms_per_token"] = per_token_ms(llm, prompt, 32)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--other-lora-kernels", default=None, metavar="FILE",
                    help="another triton_sgmv.py (an earlier version) to time beside ours")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny random Llama on the CPU, graphs emulated: the script only")
    args = ap.parse_args()
    emulate = ReplayEmulator if args.smoke else None
    llm, names, seqs = mixed_engine(args.smoke, args.tokenizer, "loraserve-gpu-shapes-")
    runner, backend = llm.engine.runner, llm.engine.runner.lora
    prompt = list(range(100, 132))
    per_token_ms(llm, prompt, 8)  # warm-up: Triton compiles, the allocator settles
    res: dict = {"device": "cpu" if args.smoke else torch.cuda.get_device_name(),
                 "torch": torch.__version__, "families": {}}
    best = []
    for family, (candidates, prefix, what) in FAMILIES.items():
        out = res["families"][family] = {}
        runs = [(spec, None) for spec in candidates]
        if family == "lora_decode" and args.other_lora_kernels:
            runs.append((Path(args.other_lora_kernels).name, args.other_lora_kernels))
        for label, other in runs:
            kernels = backend.kernels
            before = {} if other else set_kernel_shapes(label)
            try:
                if other:
                    backend.kernels = load_kernels(other)
                runner.enable_decode_graphs(seqs, llm.engine.max_model_len, emulate)
                r = time_candidate(llm, what, names, seqs, prompt)
            finally:
                backend.kernels = kernels
                set_kernel_shapes(",".join(f"{k}={v}" for k, v in before.items()))
            r["family_ms"] = sum(ms for k, (ms, _) in r["top_kernels_ms_count"].items()
                                 if k.startswith(prefix))
            out[label or "defaults"] = r
            print(family, label or "defaults", f"{prefix}* {r['family_ms']:.3f} ms,",
                  f"wall {r['wall_ms']:.3f} ms", flush=True)
        ours = [c or "defaults" for c in candidates]
        fastest = min(ours, key=lambda k: out[k]["family_ms"])
        res[f"best_{family}"] = fastest
        if fastest != "defaults":
            best.append(fastest)
    runner.enable_decode_graphs(seqs, llm.engine.max_model_len, emulate)
    res["best"] = ",".join(best)
    print("best:", res["best"] or "the defaults", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
