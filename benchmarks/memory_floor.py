"""Batch-1 decode against the memory floor, per base-weight format.

    .venv/bin/python benchmarks/memory_floor.py [--rounds 7] [--tokens 64] [--model M]
    .venv/bin/python tools/both_isas.py memory_floor      # native, then imitated AVX2

Models: the bundled SmolLM2-135M (default), or random weights in a larger model's shapes
(`--model smollm2-360m`, built in a scratch folder: nothing is downloaded). At 135M a token's
weights stream in 1-2 ms once quantized, and the engine's own time per step (scheduling,
sampling, the step's tensors) is a fixed cost on top of that; a larger model shows what the
kernels do when the weights are most of the token.

Formats: float32 ("none"), int8 and int4 quantized at load (lm_head int8 under both), and
"gguf" (the bundled model only): the bundled file's own tensors (Q4_1 projections, Q8_0
lm_head). For each, in one process, alternating the formats round by round (medians):

- floor: bytes of weights one decode token reads (every projection once, lm_head included;
  embedding lookups and norms are a row each) / the host's copy bandwidth measured in the
  same run (a 1 GiB torch copy, read + write bytes per second, as STREAM counts them);
- on a shared host other tenants' load slows every figure: each is given as the median over
  rounds and as the best (the fastest time, the highest bandwidth), the best being what this
  host does uncontended; the floor ratios use the best of both sides. Where the host swings
  between quiet and busy within a run the two bests can come from different rounds, so each
  round's ratio (its decode against its own copy rate, measured just before and after) is
  kept as well, with the round's copy rate: the rounds at the highest rate are the quiet ones;
- a read stream beside the copy: a 1 GiB torch sum, bytes read per second, per round (and
  each round's decode against it). A decode token only reads its weights; on a host whose
  copy rate is well above what a read stream reaches (two cores on different dies of one
  package: writes are posted, reads wait), the copy floor is below what any reader can do,
  and this column says by how much;
- by placement (benchmarks/placement.py): this host's two cores move between one die of the
  package and two, seconds to minutes each, and the copy rate with them (~30-34 against
  ~43-50 GB/s) while a token's time moves less; a round's copy and decode can fall in
  different placements. So each round also takes `--slices` short slices per format (a
  256 MiB copy, then a decode), each with the barrier probe just before and after it, and
  `by_placement` sets each placement's decodes against that placement's copies: best against
  best, median against median, and how many slices each had;
- proj_ms: every projection of the model once on one row, back to back (the weight stream a
  decode token is, without attention, norms or the engine): its ratio to the floor is the
  kernels' target (within 1.3x);
- decode_ms: the engine's time per output token at batch 1 (generate 1 + T tokens minus 1);
  with `--one-step-too`, the same engine with `decode_steps_per_call=1` beside it, round by
  round (one_step_ms, and runs_gain: the median over rounds of one step's time over the
  runs'), which is what taking several greedy steps per call into the native loop saves;
- prefill and 32-row decode: the projections' rows per second at 512 and 32 rows, as a ratio
  to float32's;
- greedy agreement with float32 (the bundled model: random weights have no answer to keep):
  8 English prompts x 32 tokens, the share of tokens before the first difference, and how
  many prompts match whole.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from common import median, random_llama, random_prompts, scratch_dir, write_result
from placement import tagged

from loraserve import LLM, SamplingParams
from loraserve.model.projections import weight_format
from loraserve.ops.qgemm import qgemm_isa

FORMATS = ("none", "int8", "int4", "gguf")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a little",
           "The three primary colors are", "To make a cup of tea, first",
           "Photosynthesis is the process by which", "SELECT name FROM users WHERE",
           "The best way to learn a language is"]
MODULES = ("qkv", "o", "gate_up", "down")
SHAPES = {  # random weights in these models' shapes (their config.json's fields)
    "smollm2-360m": {"hidden_size": 960, "intermediate_size": 2560, "num_hidden_layers": 32,
                     "num_attention_heads": 15, "num_key_value_heads": 5, "head_dim": 64,
                     "vocab_size": 49152, "max_position_embeddings": 8192,
                     "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True},
}


def copy_gbs(mib: int = 1024, reps: int = 5) -> float:
    """The best of `reps` 1 GiB copies, in read + write GB/s."""
    src = torch.ones(mib * 1024 * 1024 // 4)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return 2 * src.numel() * 4 / min(times[1:]) / 1e9


def read_gbs(mib: int = 1024, reps: int = 3) -> float:
    """The best of `reps` sums over 1 GiB of float32, in GB read per second."""
    x = torch.ones(mib * 1024 * 1024 // 4)
    times = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / min(times[1:]) / 1e9


def projections(model) -> list:
    return [getattr(layer, m) for layer in model.layers for m in MODULES] + [model.lm_head]


def chain_seconds(model, rows: int, head_rows: int, reps: int = 5) -> float:
    """Every projection once on `rows` rows (lm_head on `head_rows`), back to back: the best
    of `reps`."""
    lins = projections(model)
    xs = {lin.in_features: torch.randn(rows, lin.in_features) for lin in lins}
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for lin in lins[:-1]:
            lin(xs[lin.in_features])
        lins[-1](xs[lins[-1].in_features][:head_rows])
        best = min(best, time.perf_counter() - t)
    return best


def decode_seconds(llm, prompt: list[int], tokens: int) -> float:
    def run(n: int) -> float:
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        t = time.perf_counter()
        llm.generate([prompt], sp)
        return time.perf_counter() - t

    return (run(1 + tokens) - run(1)) / tokens


def greedy(llm, prompts, n: int = 32) -> list[list[int]]:
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, sp)]


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    same = [next((i for i, (a, b) in enumerate(zip(r, g, strict=True)) if a != b), len(r))
            for r, g in zip(ref, got, strict=True)]
    return {"tokens_before_first_difference": sum(same) / sum(map(len, ref)),
            "prompts_equal": sum(s == len(r) for s, r in zip(same, ref, strict=True)),
            "prompts": len(ref)}


def by_placement(samples: dict, copies: dict[str, list[float]], nbytes: int) -> dict:
    """Per placement seen in both a copy and a decode slice: the decode's time per token
    against the floor at that placement's copy rate, best against best and median against
    median."""
    out = {}
    for where in ("one_die", "two_dies"):
        decodes, rates = samples.get(("decode", where), []), copies.get(where, [])
        if not decodes or not rates:
            continue
        floor = {k: nbytes / (g * 1e9) for k, g in (("best", max(rates)),
                                                    ("median", median(rates)))}
        out[where] = {"slices": {"decode": len(decodes), "copy": len(rates)},
                      "copy_gbs": round(max(rates), 1),
                      "copy_gbs_median": round(median(rates), 1),
                      "decode_ms": round(min(decodes) * 1e3, 3),
                      "decode_ms_median": round(median(decodes) * 1e3, 3),
                      "decode_over_floor": round(min(decodes) / floor["best"], 2),
                      "decode_over_floor_median": round(median(decodes) / floor["median"], 2)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--formats", nargs="+", default=None, choices=FORMATS,
                    help="default: all the model has (gguf: the bundled model only)")
    ap.add_argument("--model", default="bundled", choices=["bundled", *SHAPES])
    ap.add_argument("--floor-only", action="store_true",
                    help="batch 1 only: no 32- and 512-row chains (short rounds)")
    ap.add_argument("--slices", type=int, default=6,
                    help="placement-tagged copy and decode slices per format and round")
    ap.add_argument("--one-step-too", action="store_true",
                    help="also decode with one step a call (decode_steps_per_call=1) each round")
    args = ap.parse_args()
    bundled = args.model == "bundled"
    formats = args.formats or [f for f in FORMATS if bundled or f != "gguf"]
    if not bundled and "gguf" in formats:
        ap.error("gguf: only the bundled model has a GGUF file")
    model_dir = None if bundled else random_llama(
        SHAPES[args.model], scratch_dir("loraserve-floor-") / args.model, torch.float32)
    load_start = os.getloadavg()
    llms = {f: LLM(model_dir, quantization=f, max_num_seqs=32, kv_cache_tokens=4096)
            for f in formats}
    one_step = {f: LLM(model_dir, quantization=f, max_num_seqs=32, kv_cache_tokens=4096,
                       decode_steps_per_call=1) for f in formats} if args.one_step_too else {}
    models = {f: llm.engine.model for f, llm in llms.items()}
    vocab = models[formats[0]].config.vocab_size
    prompt = random_prompts(1, 16, vocab, seed=1)[0]
    samples: dict[str, dict[str, list[float]]] = {f: {} for f in formats}
    bandwidth = []
    rounds: dict[str, list] = {f: [] for f in formats}  # (copy, read GB/s, decode s)
    copies: dict[str, list[float]] = {}  # placement -> GB/s of its copy slices
    for r in range(args.rounds):
        bandwidth.append(copy_gbs())
        for f in formats:
            s = samples[f]
            s.setdefault("proj", []).append(chain_seconds(models[f], 1, 1))
            if not args.floor_only:
                s.setdefault("rows32", []).append(chain_seconds(models[f], 32, 32))
                s.setdefault("rows512", []).append(chain_seconds(models[f], 512, 1))
            # one step a call before the runs in odd rounds, after them in even ones
            if f in one_step and r % 2:
                s.setdefault("one_step", []).append(decode_seconds(one_step[f], prompt,
                                                                   args.tokens))
            before, read = copy_gbs(reps=2), read_gbs()
            s.setdefault("decode", []).append(decode_seconds(llms[f], prompt, args.tokens))
            rounds[f].append(((before + copy_gbs(reps=2)) / 2, read, s["decode"][-1]))
            if f in one_step and not r % 2:
                s.setdefault("one_step", []).append(decode_seconds(one_step[f], prompt,
                                                                   args.tokens))
            for _ in range(args.slices):
                where, rate = tagged(lambda: copy_gbs(mib=256, reps=2))
                copies.setdefault(where, []).append(rate)
                where, sec = tagged(lambda f=f: decode_seconds(llms[f], prompt, args.tokens))
                s.setdefault(("decode", where), []).append(sec)
    gbs = max(bandwidth)
    ref = greedy(llms[formats[0]], PROMPTS) if bundled else None
    base = samples[formats[0]]
    out = {}
    for f in formats:
        s, model = samples[f], models[f]
        nbytes = sum(lin.nbytes for lin in projections(model))
        floor_ms = nbytes / (gbs * 1e9) * 1e3
        proj_ms, decode_ms = min(s["proj"]) * 1e3, min(s["decode"]) * 1e3
        out[f] = {
            "formats": sorted({weight_format(lin) for lin in projections(model)}),
            "weight_mb_per_token": round(nbytes / 1e6, 1),
            "floor_ms": round(floor_ms, 3),
            "proj_ms": round(proj_ms, 3), "proj_over_floor": round(proj_ms / floor_ms, 2),
            "proj_ms_median": round(median(s["proj"]) * 1e3, 3),
            "decode_ms": round(decode_ms, 3), "decode_over_floor": round(decode_ms / floor_ms, 2),
            "decode_ms_median": round(median(s["decode"]) * 1e3, 3),
            **({} if f not in one_step else {
                "one_step_ms": round(min(s["one_step"]) * 1e3, 3),
                "runs_gain": round(median([a / b for a, b in zip(s["one_step"], s["decode"],
                                                                  strict=True)]), 3)}),
            "by_placement": by_placement(s, copies, nbytes),
            "rounds": [{"copy_gbs": round(g, 1), "read_gbs": round(rd, 1),
                        "decode_over_floor": round(t / (nbytes / (g * 1e9)), 2),
                        "decode_over_read": round(t / (nbytes / (rd * 1e9)), 2)}
                       for g, rd, t in rounds[f]],
            **({} if args.floor_only else {
                "rows32_vs_float32": round(median(base["rows32"]) / median(s["rows32"]), 2),
                "prefill512_vs_float32": round(median(base["rows512"]) / median(s["rows512"]),
                                               2)}),
            "greedy_vs_float32": agreement(ref, greedy(llms[f], PROMPTS)) if bundled else None,
        }
        print(f, out[f], flush=True)
    result = {"model": args.model, "copy_gbs": round(gbs, 1),
              "copy_gbs_median": round(median(bandwidth), 1),
              "qgemm_isa": qgemm_isa(), "rounds": args.rounds,
              "decode_tokens": args.tokens, "loadavg_start": load_start,
              "loadavg_end": os.getloadavg(), "formats": out}
    print("wrote", write_result("memory_floor" if bundled else f"memory_floor-{args.model}",
                                result))


if __name__ == "__main__":
    main()
