"""`--model` takes a GGUF file: converted once into the cache (tokenizer and chat template
included), then served like any checkpoint. The files are written here (tests/gguf_factory.py)
from a tiny random Llama: float32, whose greedy tokens, with a PEFT adapter in the same batch,
must equal the original HF model's; and Q4_0, whose tokens must equal transformers' own
dequantized load of the same file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from adapter_factory import build_peft_model, load_base_model
from gguf_factory import write_llama_gguf
from model_factory import make_tiny_llama
from test_model_families import argmax_loop, prompts_for

from loraserve import LLM, SamplingParams
from loraserve.model import bundled

N = 6


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    hf = make_tiny_llama(root / "hf", initializer_range=0.3)
    return root, hf, {q: write_llama_gguf(hf, root / f"tiny-{q}.gguf", q) for q in ("F32",
                                                                                    "Q4_0")}


def greedy(llm, prompts, lora=None):
    outs = llm.generate(prompts, SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True),
                        lora=lora)
    assert all(o.error is None for o in outs)
    return [o.token_ids for o in outs]


def test_float_gguf_serves_the_original_model_with_an_adapter(files, tmp_path, monkeypatch):
    root, hf, ggufs = files
    monkeypatch.setenv("LORASERVE_CACHE", str(tmp_path / "cache"))
    peft = build_peft_model(hf, r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                            seed=3, init_scale=0.5)
    peft.save_pretrained(tmp_path / "a", safe_serialization=True)
    base, prompts = load_base_model(hf), prompts_for(3)
    llm = LLM(str(ggufs["F32"]), lora_paths={"a": str(tmp_path / "a")})
    lora = [None, "a"] * 2
    got = greedy(llm, prompts, lora)
    want = [argmax_loop(peft if name else base, p, N) for p, name in zip(prompts, lora,
                                                                         strict=True)]
    assert got == want
    # converted once: tokenizer and chat template came along; a second load reads the cache
    [entry] = [p for p in (tmp_path / "cache" / "models").iterdir()
               if p.name.startswith("gguf-tiny-F32-")]
    assert (entry / "chat_template.jinja").read_text() == (hf / "chat_template.jinja").read_text()
    messages = [{"role": "user", "content": "hello world"}]
    assert llm.tokenizer.apply_chat_template(messages) == _hf_chat_ids(hf, messages)

    def boom(*a):
        raise AssertionError("converted twice")

    monkeypatch.setattr(bundled, "_convert", boom)
    assert greedy(LLM(str(ggufs["F32"])), prompts[:1]) == want[:1]


def _hf_chat_ids(model_dir: Path, messages) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                   return_dict=True)["input_ids"]


def test_quantized_gguf_serves_transformers_dequantized_model(files, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    root, hf, ggufs = files
    monkeypatch.setenv("LORASERVE_CACHE", str(tmp_path / "cache"))
    path = ggufs["Q4_0"]
    ref = AutoModelForCausalLM.from_pretrained(root, gguf_file=path.name,
                                               dtype=torch.float32).eval()
    prompts = prompts_for(4)
    want = [argmax_loop(ref, p, N) for p in prompts]
    assert greedy(LLM(str(path)), prompts) == want
    # quantization did change the model: the original's tokens are not these
    base = load_base_model(hf)
    assert any(argmax_loop(base, p, N) != w for p, w in zip(prompts, want, strict=True))


def test_a_file_that_is_not_gguf_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("LORASERVE_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ValueError) as e:
        LLM(str(bad))
    assert "cannot convert GGUF file" in str(e.value) and "\n" not in str(e.value)
    assert not [p for p in (tmp_path / "cache" / "models").iterdir()
                if not p.name.endswith(".lock")]


def test_a_full_cache_directory_is_one_line(files, tmp_path, monkeypatch, capsys):
    """safetensors reports a full disk as its own error: the CLI still says it in one line,
    naming the cache directory, and leaves no half-written entry."""
    import transformers.modeling_utils as mu
    from safetensors import SafetensorError

    from loraserve.cli import main

    def full(*a, **kw):
        raise SafetensorError("Error while serializing: I/O error: No space left on device "
                              "(os error 28)")

    monkeypatch.setattr(mu, "safe_save_file", full)
    cache = tmp_path / "cache"
    monkeypatch.setenv("LORASERVE_CACHE", str(cache))
    _, _, ggufs = files
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(ggufs["F32"]), "--prompt", "hi"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("loraserve generate: the cache directory") and "No space left" in err
    assert "Traceback" not in capsys.readouterr().err
    assert not [p for p in (cache / "models").iterdir() if not p.name.endswith(".lock")]


def test_parsing_the_header_once_converts_byte_for_byte_the_same(files, tmp_path, monkeypatch):
    """The conversion memoizes gguf's reader and tensor-name table (model/gguf_parse_once.py);
    without that, transformers' own repeated parses give the very same files."""
    import contextlib

    import gguf

    from loraserve.model import gguf_parse_once

    _, _, ggufs = files
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    bundled._convert(ggufs["Q4_0"], tmp_path / "once")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)  # restored
    with gguf_parse_once.parse_once():
        assert gguf.GGUFReader(ggufs["F32"]) is gguf.GGUFReader(ggufs["F32"])
    monkeypatch.setattr(gguf_parse_once, "parse_once", contextlib.nullcontext)
    bundled._convert(ggufs["Q4_0"], tmp_path / "plain")
    names = sorted(p.name for p in (tmp_path / "once").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "plain").iterdir())
    assert "model.safetensors" in names and "tokenizer.json" in names
    for name in names:
        assert (tmp_path / "once" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes()
