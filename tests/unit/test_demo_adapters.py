"""The demo adapters shipped in loraserve/demo/data: readable by our loader, picked up by
ensure_demo_adapters without training, and (slow) visibly changing the bundled model's answers
under the transformers + PEFT reference."""

from __future__ import annotations

import pytest

from loraserve.adapters.format import read_adapter
from loraserve.config import ModelConfig
from loraserve.demo.adapters import RECIPE, SHIPPED, ensure_demo_adapters
from loraserve.demo.personas import PERSONAS

QUESTION = "What is the capital of Spain?"  # held out from the training data


@pytest.mark.parametrize("name", sorted(PERSONAS))
def test_shipped_adapter_reads(bundled_model_dir, name):
    mc = ModelConfig.from_dir(bundled_model_dir)
    w = read_adapter(SHIPPED / name, mc, max_lora_rank=64)
    assert w.rank == RECIPE["r"]
    assert w.target_modules == frozenset(RECIPE["target_modules"])
    first = mc.num_hidden_layers - RECIPE["top_layers"]
    # LoRA only on the top layers; the layers below have no modules at all.
    assert all(not w.layers[i] for i in range(first))
    assert all(set(w.layers[i]) == w.target_modules for i in range(first, mc.num_hidden_layers))


def test_ensure_prefers_shipped_copies(bundled_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("LORASERVE_CACHE", str(tmp_path))  # a training run would land here
    paths = ensure_demo_adapters(bundled_model_dir)
    assert paths == {name: SHIPPED / name for name in PERSONAS}
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_adapters_change_greedy_answers(bundled_model_dir):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bundled_model_dir)
    base = AutoModelForCausalLM.from_pretrained(bundled_model_dir, dtype=torch.float32).eval()
    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTION}],
                                     add_generation_prompt=True, tokenize=False)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)

    def answer(model) -> str:
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=10, do_sample=False)
        return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)

    base_answer = answer(base)
    names = sorted(PERSONAS)
    model = PeftModel.from_pretrained(base, SHIPPED / names[0], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(SHIPPED / name, adapter_name=name)
    answers = {}
    for name in names:
        model.set_adapter(name)
        answers[name] = answer(model.eval())
    assert all(a != base_answer for a in answers.values()), (base_answer, answers)
    # Each persona's signature shows from the first tokens on.
    assert answers["pirate"].startswith("Arr, matey!"), answers
    assert answers["french"].startswith("Bonjour !"), answers
    letters = [c for c in answers["shouty"] if c.isalpha()]
    assert letters and sum(c.isupper() for c in letters) >= 0.9 * len(letters), answers
