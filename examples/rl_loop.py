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

The reward is a toy: 1 if the completion contains `--target-word`, plus a bonus for short
answers. Run (a few minutes on 2 cores with the bundled SmolLM2-135M-Instruct):

    python examples/rl_loop.py                       # starts its own server on loopback
    python examples/rl_loop.py --server-url http://127.0.0.1:8000   # a server started with
        # --allow-runtime-lora-updates (and --max-lora-rank >= --rank)
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from safetensors.torch import save as safetensors_bytes
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPTS = [
    "Name one animal that people keep as a pet.",
    "What animal says meow?",
    "Tell me about a small furry animal.",
    "Which animal likes to chase mice?",
    "Write a word about animals.",
    "What is your favourite pet?",
    "Describe a house pet in one sentence.",
    "Pick an animal.",
]
ATTENTION_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]


@dataclass
class Rollout:
    prompt_index: int
    version: str  # the response's `model`: policy@N
    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logprobs: list[float]  # the sampling version's logprob of each completion token
    text: str
    reward: float


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


def reward(text: str, target_word: str, max_chars: int) -> float:
    """1 if the answer mentions the word, plus up to 0.5 for being short."""
    hit = 1.0 if target_word.lower() in text.lower() else 0.0
    return hit + 0.5 * (1.0 - min(len(text), max_chars) / max_chars)


class Sampler:
    """Rollouts without pause: `concurrency` threads, each sending one group request (one
    prompt x n) after another to `policy` (its newest version) until stopped; finished groups
    go to a queue the trainer reads."""

    def __init__(self, base_url: str, args: argparse.Namespace, tokenizer):
        self.client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0,
                                    timeout=600)
        self.args = args
        self.tokenizer = tokenizer
        self.groups: queue.Queue[list[Rollout] | BaseException] = queue.Queue()
        self._next_prompt = itertools.count()
        self._lock = threading.Lock()
        self.in_flight = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._work, daemon=True)
                         for _ in range(args.concurrency)]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()

    def prompt_ids(self, i: int) -> list[int]:
        messages = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _work(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                i = next(self._next_prompt)
                self.in_flight += 1
            try:
                self.groups.put(self._sample(i))
            except BaseException as e:  # the trainer re-raises it
                self.groups.put(e)
                return
            finally:
                with self._lock:
                    self.in_flight -= 1

    def _sample(self, i: int) -> list[Rollout]:
        a = self.args
        ids = self.prompt_ids(i)
        r = self.client.completions.create(
            model="policy", prompt=ids, n=a.n, max_tokens=a.max_tokens, temperature=1.0,
            logprobs=0, seed=a.seed * 100003 + i,
            extra_body={"return_tokens_as_token_ids": True})
        out = []
        for c in r.choices:
            completion = [int(t.removeprefix("token_id:")) for t in c.logprobs.tokens]
            text = self.tokenizer.decode(completion, skip_special_tokens=True)
            out.append(Rollout(i, r.model, ids, completion, list(c.logprobs.token_logprobs),
                               text, reward(text, a.target_word, 4 * a.max_tokens)))
        return out

    def batch(self, groups: int, oldest_version: int) -> tuple[list[Rollout], int]:
        """The next `groups` groups sampled by `policy@oldest_version` or newer, and how many
        older ones were dropped (their importance ratios would be too far from 1)."""
        out, dropped = [], 0
        while len(out) < groups:
            group = self.groups.get()
            if isinstance(group, BaseException):
                raise group
            if version_number(group[0].version) < oldest_version:
                dropped += 1
                continue
            out.append(group)
        return [r for g in out for r in g], dropped


def version_number(model: str) -> int:
    return int(model.rsplit("@", 1)[1])


class Trainer:
    """The policy: the base model in float32 with a LoRA on the attention projections."""

    def __init__(self, model_dir: str, args: argparse.Namespace):
        torch.manual_seed(args.seed)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.config = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                                 target_modules=ATTENTION_MODULES, task_type="CAUSAL_LM")
        self.model = get_peft_model(base, self.config)
        self.opt = torch.optim.Adam([p for p in self.model.parameters() if p.requires_grad],
                                    lr=args.lr)
        self.clip = args.clip

    def step(self, rollouts: list[Rollout]) -> dict:
        """One policy-gradient step on a batch of groups; returns the loss and mean ratio."""
        groups: dict[int, list[Rollout]] = {}
        for r in rollouts:
            groups.setdefault(r.prompt_index, []).append(r)
        advantages = {}
        for members in groups.values():
            rewards = torch.tensor([r.reward for r in members])
            norm = (rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-4)
            advantages.update({id(r): float(a) for r, a in zip(members, norm, strict=True)})
        rows = [r for r in rollouts if r.completion_ids]
        # one right-padded batch; position j predicts token j + 1
        width = max(len(r.prompt_ids) + len(r.completion_ids) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        sampled = torch.zeros(len(rows), width - 1, dtype=torch.bool)  # predicts a sample
        behaviour = torch.zeros(len(rows), width - 1)
        adv = torch.zeros(len(rows), width - 1)
        for i, r in enumerate(rows):
            p, c = len(r.prompt_ids), len(r.completion_ids)
            ids[i, :p + c] = torch.tensor(r.prompt_ids + r.completion_ids)
            mask[i, :p + c] = 1
            sampled[i, p - 1:p + c - 1] = True
            behaviour[i, p - 1:p + c - 1] = torch.tensor(r.behaviour_logprobs)
            adv[i, p - 1:p + c - 1] = advantages[id(r)]
        self.model.train()
        self.opt.zero_grad()
        logits = self.model(input_ids=ids, attention_mask=mask).logits[:, :-1][sampled]
        # logits: [sampled tokens, vocab]; the policy's logprob of each sampled token
        logp = torch.log_softmax(logits.float(), -1).gather(
            1, ids[:, 1:][sampled][:, None])[:, 0]
        ratio = torch.exp(logp - behaviour[sampled])
        a = adv[sampled]
        clipped = torch.clamp(ratio, 1 - self.clip, 1 + self.clip)
        loss = -torch.minimum(ratio * a, clipped * a).mean()
        loss.backward()
        self.opt.step()
        self.model.eval()
        # on-policy rows (the trainer's weights = the sampling version's) have ratio 1: the
        # server's logprobs are the model's own distribution, as the trainer computes it
        return {"loss": loss.item(), "mean_ratio": ratio.mean().item(),
                "max_abs_log_ratio": (logp - behaviour[sampled]).abs().max().item()}

    def adapter_files(self) -> dict:
        """The LoRA as PEFT would save it, built in memory: (config, safetensors) bytes."""
        tensors = {k: v.detach().contiguous()
                   for k, v in get_peft_model_state_dict(self.model).items()}
        config = json.dumps(self.config.to_dict(),
                            default=lambda v: sorted(v) if isinstance(v, set) else str(v))
        return {"config": ("adapter_config.json", config.encode()),
                "weights": ("adapter_model.safetensors", safetensors_bytes(tensors))}


def push(base_url: str, trainer: Trainer) -> tuple[int, float]:
    """Upload the trainer's LoRA as the new version of `policy`; (version, seconds)."""
    t = time.perf_counter()
    r = httpx.post(base_url + "/v1/upload_lora_adapter", files=trainer.adapter_files(),
                   data={"lora_name": "policy", "replace": "true"}, timeout=120)
    if r.status_code != 200:
        raise RuntimeError(f"upload refused ({r.status_code}): {r.text}")
    return r.json()["version"], time.perf_counter() - t


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
