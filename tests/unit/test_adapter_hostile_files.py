"""Hostile adapter files are refused within bounded time, naming the bound or the field
(adapters/peft/budget.py, safetensors_header.py, files.py, file_errors.py)."""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import threading
import time

import pytest
from adapter_factory import build_peft_model, edit_config

from loraserve.adapters.format import read_adapter
from loraserve.adapters.peft import files
from loraserve.adapters.peft.budget import MAX_CONFIG_BYTES, MAX_PATTERNS, LoadBudget
from loraserve.adapters.peft.safetensors_header import read_header
from loraserve.config import ModelConfig
from loraserve.types import (
    AdapterFilesChangedError,
    AdapterFormatError,
    AdapterLoadCancelledError,
)

BOUND_S = 5.0  # every refusal here comes back well within it


@pytest.fixture(scope="module")
def mc(tiny_model_dir):
    return ModelConfig.from_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def good_dir(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("good")
    build_peft_model(tiny_model_dir, r=4, target_modules=["q_proj", "v_proj"],
                     seed=3).save_pretrained(out)
    return out


@pytest.fixture
def bad(good_dir, tmp_path):
    return shutil.copytree(good_dir, tmp_path / "adapter")


def refused(path, mc, match, **kw):
    t0 = time.monotonic()
    with pytest.raises(AdapterFormatError, match=match) as ei:
        read_adapter(path, mc, max_lora_rank=64, **kw)
    assert time.monotonic() - t0 < BOUND_S
    return ei.value


def test_backtracking_rank_pattern_loads_at_once(bad, mc):
    """`.*` nine times then Z: minutes for Python's re per module name; it matches nothing, so
    every module keeps r."""
    edit_config(bad, rank_pattern={".*" * 9 + "Z": 8, r"(\w+\.?)+q_proj": 4}, r=4)
    t0 = time.monotonic()
    ad = read_adapter(bad, mc, max_lora_rank=64)
    assert time.monotonic() - t0 < BOUND_S
    assert ad.rank == 4


def test_200000_key_rank_pattern_is_refused_by_size(bad, mc):
    edit_config(bad, rank_pattern={f"model.layers.0.self_attn.q_proj_{i}": 4
                                   for i in range(200_000)})
    refused(bad, mc, f"at most {MAX_CONFIG_BYTES}")


def test_too_many_patterns_is_refused_naming_the_bound(bad, mc):
    edit_config(bad, rank_pattern={f"k{i}": 4 for i in range(MAX_PATTERNS + 1)})
    refused(bad, mc, f"the per-load bound is {MAX_PATTERNS}")


@pytest.mark.parametrize("depth", [20, 100_000])
def test_deep_config_is_refused_naming_the_depth(bad, mc, depth):
    cfg = json.loads((bad / "adapter_config.json").read_text())
    text = json.dumps(cfg)[:-1] + ', "x": ' + "[" * depth + "]" * depth + "}"
    (bad / "adapter_config.json").write_text(text)
    refused(bad, mc, "nests (deeper|too deeply)")


def test_oversized_config_is_refused_before_it_is_read(bad, mc):
    with open(bad / "adapter_config.json", "r+b") as f:
        f.truncate(200 << 20)  # sparse: costs no disk
    refused(bad, mc, "size bound")


def test_time_budget_and_cancel(bad, mc):
    refused(bad, mc, "time budget of 0 s", budget=LoadBudget(seconds=0))
    stop = threading.Event()
    stop.set()
    with pytest.raises(AdapterLoadCancelledError):
        read_adapter(bad, mc, max_lora_rank=64, budget=LoadBudget(cancelled=stop))


def _with_header(bad, edit) -> None:
    st = bad / "adapter_model.safetensors"
    data = st.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    st.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def _first(header) -> dict:
    return next(v for k, v in header.items() if k != "__metadata__")


@pytest.mark.parametrize("field,value,match", [
    ("data_offsets", 7, "data_offsets must be a list of two integers"),
    ("data_offsets", "0,8", "data_offsets must be a list of two integers"),
    ("data_offsets", {"a": 1}, "data_offsets must be a list of two integers"),
    ("data_offsets", [], "data_offsets must be a list of two integers"),
    ("data_offsets", [0, True], "data_offsets must be a list of two integers"),
    ("data_offsets", [-8, 0], "outside the data"),
    ("data_offsets", [0, 10**12], "outside the data"),
    ("dtype", "I32", "not a floating-point dtype"),
    ("dtype", ["F32"], "not a floating-point dtype"),
    ("shape", "4x64", "shape must be a list"),
    ("shape", [4, -64], "shape must be a list"),
    ("shape", [4, 65], "needs"),
    ("extra", 1, "unknown fields"),
])
def test_every_malformed_header_field_is_a_400(bad, mc, field, value, match):
    _with_header(bad, lambda h: _first(h).__setitem__(field, value))
    refused(bad, mc, match)


def test_overlapping_tensors_and_bad_metadata(bad, mc, good_dir, tmp_path):
    def overlap(h):
        a, b = [v for k, v in h.items() if k != "__metadata__"][:2]
        b["data_offsets"] = list(a["data_offsets"])
    _with_header(bad, overlap)
    refused(bad, mc, "gap or overlap|needs")
    other = shutil.copytree(good_dir, tmp_path / "meta")
    _with_header(other, lambda h: h.__setitem__("__metadata__", {"format": 1}))
    refused(other, mc, "__metadata__")


def test_header_is_judged_before_the_data_is_read():
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": 5}}).encode()
    f = io.BytesIO(struct.pack("<Q", len(header)) + header + b"\0" * 4096)
    with pytest.raises(AdapterFormatError, match="data_offsets"):
        read_header(f, len(f.getvalue()), "adapter_model.safetensors", "x", max_tensors=10)
    assert f.tell() == 8 + len(header)  # not one byte of the data


def test_hard_links_under_the_root_are_refused(bad, mc, tmp_path):
    outside = tmp_path / "outside.safetensors"
    os.link(bad / "adapter_model.safetensors", outside)
    refused(bad, mc, "hard link", root=str(bad.parent))
    os.unlink(outside)
    assert read_adapter(bad, mc, max_lora_rank=64, root=str(bad.parent)).rank == 4
    os.link(bad / "adapter_model.safetensors", outside)  # without a root: anything goes
    assert read_adapter(bad, mc, max_lora_rank=64).rank == 4


def test_a_file_vanishing_mid_load_is_not_the_clients_mistake(bad, mc, monkeypatch):
    check = files.check_inside

    def then_vanish(file, root, path):
        check(file, root, path)
        if file.name == "adapter_model.safetensors":
            file.unlink()  # the operator's files change between the check and the open

    monkeypatch.setattr("loraserve.adapters.format.check_inside", then_vanish)
    with pytest.raises(AdapterFilesChangedError, match="vanished") as ei:
        read_adapter(bad, mc, max_lora_rank=64)
    assert ei.value.status == 409


def test_a_path_too_long_is_a_400(mc, tmp_path):
    with pytest.raises(AdapterFormatError):
        read_adapter(tmp_path / ("x" * 300), mc, max_lora_rank=64)
    with pytest.raises(AdapterFormatError):
        read_adapter("/" + "/".join(["y" * 200] * 30), mc, max_lora_rank=64)
