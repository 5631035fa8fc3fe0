"""The demo LoRA adapters (pirate, shouty, french) for the bundled SmolLM2-135M-Instruct.

Copies ship inside the package (`loraserve/demo/data/<name>/`), so `make serve` starts at once.
Without them (or for another base model of a different shape) they are made by a short real
PEFT fine-tune on the synthetic data of `personas.py` and cached under
`$LORASERVE_CACHE/demo-adapters/<name>` (default `~/.cache/loraserve`); a stamp records the
recipe, so changing it retrains. `python -m loraserve.demo.adapters --retrain --ship` rebuilds
them (about 3 minutes on 2 free cores) and refreshes the shipped copies.

Speed on 2 CPU cores: LoRA sits only in the top 12 of the 30 layers, so the hidden states
entering them are computed once (no grad) and reused by every step; each step runs just the
top layers and the LM head on answer tokens. That cuts a step several-fold versus a full pass.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch

from loraserve.demo.personas import HELD_OUT, PERSONAS, examples

RECIPE = {  # bump "version" on any change that should retrain cached adapters
    "version": 4, "r": 8, "lora_alpha": 16, "top_layers": 12, "steps": 60, "batch": 8,
    "lr": 2e-3, "seed": 0,
    "target_modules": ["q_proj", "v_proj", "o_proj", "up_proj"],
}
STAMP = "loraserve_demo.json"
SHIPPED = Path(__file__).parent / "data"
FILES = ("adapter_config.json", "adapter_model.safetensors")


def cache_dir() -> Path:
    env = os.environ.get("LORASERVE_CACHE")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "loraserve"
    return root / "demo-adapters"


def _model_shape(base_dir: Path) -> dict:
    cfg = json.loads((Path(base_dir) / "config.json").read_text())
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "vocab_size")
    return {k: cfg.get(k) for k in keys}


def _stamp(base_dir: Path) -> dict:
    return {"recipe": RECIPE, "model": _model_shape(base_dir)}


def _is_valid(path: Path, stamp: dict) -> bool:
    if not all((path / f).is_file() for f in FILES):
        return False
    try:
        return json.loads((path / STAMP).read_text()) == stamp
    except (OSError, ValueError):
        return False


def ensure_demo_adapters(
    base_dir: str | os.PathLike, out_root: str | os.PathLike | None = None,
    retrain: bool = False,
) -> dict[str, Path]:
    """{name: adapter dir} for every persona: the shipped copy when it fits `base_dir` (and
    `out_root` is not given), else a cached one, training whatever is missing or stale."""
    base_dir = Path(base_dir)
    stamp = _stamp(base_dir)
    out = {}
    if out_root is None and not retrain:
        out = {n: SHIPPED / n for n in PERSONAS if _is_valid(SHIPPED / n, stamp)}
    root = Path(out_root) if out_root is not None else cache_dir()
    todo = []
    for name in PERSONAS:
        if name not in out:
            out[name] = root / name
            if retrain or not _is_valid(root / name, stamp):
                todo.append(name)
    if todo:
        train_adapters(base_dir, root, todo, stamp)
    return out


def _prompt(tok, question: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": question}],
                                   add_generation_prompt=True, tokenize=False)


def _encode(tok, question: str, answer: str) -> tuple[list[int], int]:
    """Token ids of the chat-formatted exchange and where the answer starts. The answer ends
    with <|im_end|> so the adapter also learns to stop."""
    p_ids = tok(_prompt(tok, question), add_special_tokens=False)["input_ids"]
    a_ids = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return p_ids + a_ids, len(p_ids)


def _run_layers(model, layers, h: torch.Tensor) -> torch.Tensor:
    """Decoder layers on right-padded hidden states h: [B, T, d]. No mask is needed: with
    causal attention real tokens never see the padding after them."""
    pos = torch.arange(h.shape[1]).unsqueeze(0)
    pe = model.model.rotary_emb(h, position_ids=pos)
    for layer in layers:
        h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
        h = h[0] if isinstance(h, tuple) else h
    return h


def _pad(seqs: list[torch.Tensor]) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)


def train_adapters(base_dir: Path, root: Path, names: list[str], stamp: dict) -> None:
    """Fine-tune each persona in `names` into `root/<name>` on 2 threads (the recipe's
    budget), restoring the thread count after: a server may run in this process next."""
    prev = torch.get_num_threads()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    try:
        _train(base_dir, root, names, stamp)
    finally:
        torch.set_num_threads(prev)


def _train(base_dir: Path, root: Path, names: list[str], stamp: dict) -> None:
    from peft import LoraConfig, get_peft_model
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    n_layers = model.config.num_hidden_layers
    first = max(0, n_layers - RECIPE["top_layers"])
    root.mkdir(parents=True, exist_ok=True)
    for name in names:
        start = time.monotonic()
        seqs = [_encode(tok, q, a) for q, a in examples(name)]
        ids = [torch.tensor(s) for s, _ in seqs]
        # Hidden states entering the first LoRA layer do not depend on the adapter: once.
        with torch.no_grad():
            h = _run_layers(model, model.model.layers[:first],
                            model.model.embed_tokens(_pad(ids)))
        cached = [h[i, : len(s)] for i, s in enumerate(ids)]
        torch.manual_seed(RECIPE["seed"])
        cfg = LoraConfig(r=RECIPE["r"], lora_alpha=RECIPE["lora_alpha"], lora_dropout=0.0,
                         target_modules=RECIPE["target_modules"], task_type="CAUSAL_LM",
                         layers_to_transform=list(range(first, n_layers)))
        pm = get_peft_model(model, cfg)
        lm = pm.base_model.model
        opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad],
                                lr=RECIPE["lr"], weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / 5) * (1 - s / RECIPE["steps"]))
        rng = random.Random(RECIPE["seed"])
        order: list[int] = []
        bar = tqdm(range(RECIPE["steps"]), desc=f"training demo adapter {name!r}")
        for _ in bar:
            if len(order) < RECIPE["batch"]:
                order += rng.sample(range(len(seqs)), len(seqs))
            batch, order = order[: RECIPE["batch"]], order[RECIPE["batch"]:]
            h = _run_layers(lm, lm.model.layers[first:], _pad([cached[i] for i in batch]))
            # Position t predicts token t+1: gather only the positions that predict answers.
            rows, cols, targets = [], [], []
            for row, i in enumerate(batch):
                s, p = seqs[i]
                rows += [row] * (len(s) - p)
                cols += range(p - 1, len(s) - 1)
                targets += s[p:]
            logits = lm.lm_head(lm.model.norm(h[rows, cols]))
            loss = torch.nn.functional.cross_entropy(logits, torch.tensor(targets))
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            bar.set_postfix(loss=f"{loss.item():.3f}")
        _save(pm, root / name, stamp)
        model = pm.unload()  # strip the LoRA layers so the next persona starts from the base
        print(f"demo adapter {name!r} trained in {time.monotonic() - start:.0f} s")


def _save(pm, target: Path, stamp: dict) -> None:
    """save_pretrained into a temp dir beside `target`, then swap it into place."""
    pm.peft_config["default"].base_model_name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        # save_embedding_layers="auto" would look the base model up on the Hub.
        pm.save_pretrained(tmp, safe_serialization=True, save_embedding_layers=False)
        (tmp / "README.md").unlink(missing_ok=True)
        (tmp / STAMP).write_text(json.dumps(stamp, indent=1) + "\n")
        os.chmod(tmp, 0o755)
        if target.exists():  # stale entry: move it aside, then replace it
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.rename(target, old / "entry")
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:  # a concurrent run put its copy in place first: keep that one
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def generate(base_dir: Path, adapter: Path | None, questions, max_new_tokens: int = 40):
    """Greedy answers with transformers (+ peft): the reference, used to check the personas."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    answers = []
    for q in questions:
        ids = tok(_prompt(tok, q), return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
        answers.append(tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
    return answers


def main(argv: list[str] | None = None) -> None:
    from loraserve.model.bundled import default_model_dir

    ap = argparse.ArgumentParser(prog="python -m loraserve.demo.adapters", description=__doc__)
    ap.add_argument("--retrain", action="store_true", help="train even if cached/shipped")
    ap.add_argument("--out", default=None, help="output root (default: the user cache)")
    ap.add_argument("--ship", action="store_true", help="copy the results into the package")
    ap.add_argument("--check", action="store_true", help="print greedy answers, base vs each")
    args = ap.parse_args(argv)
    base = default_model_dir()
    start = time.monotonic()
    paths = ensure_demo_adapters(base, args.out, retrain=args.retrain)
    print(f"adapters ready in {time.monotonic() - start:.0f} s:")
    for name, path in paths.items():
        print(f"  {name}: {path}")
        if args.ship and path.parent != SHIPPED:
            (SHIPPED / name).mkdir(parents=True, exist_ok=True)
            for f in (*FILES, STAMP):
                shutil.copyfile(path / f, SHIPPED / name / f)
    if args.check:
        torch.set_num_threads(min(2, os.cpu_count() or 1))
        runs = {"base": None, **paths}
        answers = {n: generate(base, p, HELD_OUT) for n, p in runs.items()}
        for i, q in enumerate(HELD_OUT):
            print(f"\nQ: {q}")
            for n in runs:
                print(f"  [{n}] {answers[n][i]!r}")


if __name__ == "__main__":
    main()
