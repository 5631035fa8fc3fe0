"""A small GRPO-style RL loop against a live loraserve server: sampling never stops for an update.

The trainer (transformers + PEFT, float32, on the CPU) keeps a LoRA policy; the server samples
from it, without pause:

- `--concurrency` sampler threads send group requests (one prompt x `n` completions) to
  `policy`, its newest version, one after another, through the OpenAI client; each response's
  `model` says which version sampled it (`policy@N`), and its logprobs (the model's own
  distribution, before temperature) are the behaviour policy's, kept for the importance ratio;
- each iteration the trainer takes the next `--prompts` groups (dropping groups more than
  `--max-lag` versions old), and takes one policy-gradient step: group-normalized advantages
  (each group's rewards minus their mean, over their std) and a PPO-clipped ratio against the
  behaviour logprobs, on the sampled token ids;
- it pushes the new LoRA straight from memory (`peft.get_peft_model_state_dict`, serialized
  and sent as a multipart upload with `replace`): the server answers `policy@N+1`; requests
  admitted from then on sample from it, while those already running (the sampler never
  stops) finish on the version they started with.

The sampler and the trainer are in rl_sampler_trainer.py, beside this script.

The reward is a toy: 1 if the completion contains `--target-word`, plus a bonus for short
answers. Run (a few minutes on 2 cores with the bundled SmolLM2-135M-Instruct):

    python examples/rl_loop.py                       # starts its own server on loopback
    python examples/rl_loop.py --server-url http://127.0.0.1:8000   # a server started with
        # --allow-runtime-lora-updates (and --max-lora-rank >= --rank)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from rl_sampler_trainer import Sampler, Trainer, push, version_number
from transformers import AutoTokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help="HF checkpoint directory (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--server-url", default=None,
                   help="use this running server (default: start one on loopback)")
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--prompts", type=int, default=4, help="prompts per iteration")
    p.add_argument("--n", type=int, default=4, help="samples per prompt (the GRPO group)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=0.2, help="PPO ratio clip")
    p.add_argument("--target-word", default="cat")
    p.add_argument("--concurrency", type=int, default=2,
                   help="rollout requests in flight at once (one request = one prompt x n)")
    p.add_argument("--max-lag", type=int, default=1,
                   help="train on rollouts of the newest version or up to this many older")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the trainer and of the server it starts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write a JSON summary of the run here")
    return p.parse_args(argv)


def start_server(model_dir: str, args: argparse.Namespace, log_dir: Path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(log_dir / "server.log", "wb")  # noqa: SIM115
    cmd = [sys.executable, "-m", "loraserve.cli", "serve", "--model", model_dir, "--port",
           str(port), "--allow-runtime-lora-updates", "--max-lora-rank", str(args.rank),
           "--num-threads", str(args.threads)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {(log_dir / 'server.log').read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise TimeoutError("server did not start")


def run(args: argparse.Namespace) -> dict:
    if args.model is None:
        from loraserve.model.bundled import default_model_dir

        args.model = str(default_model_dir())
    torch.set_num_threads(args.threads)
    proc = None
    with tempfile.TemporaryDirectory(prefix="rl-loop-") as tmp:
        url = args.server_url
        if url is None:
            proc, url = start_server(args.model, args, Path(tmp))
        try:
            return loop(url, args)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(30)


def loop(url: str, args: argparse.Namespace) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    trainer = Trainer(args.model, args)
    version, secs = push(url, trainer)  # policy@1: the untrained LoRA (B = 0: the base model)
    print(f"pushed policy@{version} (initial) in {secs:.2f}s", flush=True)
    sampler = Sampler(url, args, tokenizer)
    pushed, history = [version], []
    try:
        for it in range(args.iterations):
            t0 = time.perf_counter()
            batch, dropped = sampler.batch(args.prompts, version - args.max_lag)
            stats = trainer.step(batch)  # sampling goes on on the server meanwhile
            in_flight = sampler.in_flight
            version, push_s = push(url, trainer)
            pushed.append(version)
            used = collections.Counter(r.version for r in batch)
            mean_reward = statistics.fmean(r.reward for r in batch)
            history.append({"iteration": it, "rollout_versions": [r.version for r in batch],
                            "rewards": [r.reward for r in batch], "mean_reward": mean_reward,
                            "dropped_stale_groups": dropped, "pushed": version,
                            "push_s": push_s, "requests_in_flight_at_push": in_flight,
                            **stats, "seconds": time.perf_counter() - t0})
            print(f"iter {it}: {len(batch)} rollouts from "
                  f"{', '.join(f'{v} x{k}' for v, k in sorted(used.items()))}"
                  f"{f' ({dropped} stale groups dropped)' if dropped else ''}  mean reward "
                  f"{mean_reward:.3f}  loss {stats['loss']:+.4f}  ratio "
                  f"{stats['mean_ratio']:.3f} -> pushed policy@{version} in {push_s:.2f}s "
                  f"with {in_flight} rollout requests in flight "
                  f"({time.perf_counter() - t0:.1f}s)", flush=True)
            print(f"    e.g. {batch[0].text!r}", flush=True)
    finally:
        sampler.stop()
    by_version: dict[str, list[float]] = {}
    for h in history:
        for v, rew in zip(h["rollout_versions"], h["rewards"], strict=True):
            by_version.setdefault(v, []).append(rew)
    print("mean reward by the version that sampled the rollout:")
    for v in sorted(by_version, key=version_number):
        rs = by_version[v]
        print(f"  {v}: {statistics.fmean(rs):.3f} over {len(rs)} rollouts")
    summary = {"pushed_versions": pushed, "iterations": history,
               "mean_reward_by_version": {v: statistics.fmean(rs)
                                          for v, rs in by_version.items()}}
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
