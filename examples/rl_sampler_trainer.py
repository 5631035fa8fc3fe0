"""The two sides of examples/rl_loop.py's loop. The sampler: threads that send group requests
(one prompt x n completions) to the server's `policy` without pause, keeping each completion's
token ids, the behaviour logprobs of the version that sampled it and its toy reward. The
trainer: a PEFT LoRA on the base model in float32 that takes one policy-gradient step on a
batch of groups (group-normalized advantages, a PPO-clipped ratio), and `push`, which uploads
it from memory as the next version of `policy`."""

from __future__ import annotations

import argparse
import itertools
import json
import queue
import threading
import time
from dataclasses import dataclass

import httpx
import openai
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from safetensors.torch import save as safetensors_bytes
from transformers import AutoModelForCausalLM

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
