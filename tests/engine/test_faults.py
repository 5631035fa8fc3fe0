"""Faults, offline and at start: adapter files deleted or corrupted between
registration and an implicit reload fail only that adapter's requests, with a clear 4xx, and
the name can be registered again; a reload of a name with new weights while the old version's
requests run lets them finish on the weights they started with; an unusable or full cache
directory stops `serve` with one clear line, never a traceback."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from adapter_factory import make_peft_adapter
from lora_reference import P1, P2, P3, assert_idle, gen, greedy
from server_utils import REPO

from loraserve import LLM
from loraserve.types import FinishReason

WEIGHTS = "adapter_model.safetensors"


def _delete(path: Path) -> None:
    (path / WEIGHTS).unlink()


def _corrupt(path: Path) -> None:
    data = bytearray((path / WEIGHTS).read_bytes())
    (path / WEIGHTS).write_bytes(bytes(data[: len(data) // 2]))  # a torn write


def _garbage(path: Path) -> None:
    (path / WEIGHTS).write_bytes(b"\x00not safetensors at all" * 10)


@pytest.mark.parametrize("damage", [_delete, _corrupt, _garbage])
@pytest.mark.parametrize("lora_memory", ["tiered", "unified"])
def test_damaged_files_fail_only_that_adapter_and_it_can_come_back(tiny_model_dir, tmp_path,
                                                                   damage, lora_memory):
    spec = dict(r=4, seed=11)
    a = make_peft_adapter(tiny_model_dir, tmp_path / "a", **spec)
    b = make_peft_adapter(tiny_model_dir, tmp_path / "b", r=4, seed=12)
    llm = LLM(str(tiny_model_dir), lora_memory=lora_memory, max_loaded_loras=1,
              lora_paths={"a": str(a)})
    before = gen(llm, [P1, P2, P3], ["a", None, None])
    llm.load_lora_adapter("b", str(b))  # evicts a from host memory: its next use reloads
    b_alone = gen(llm, [P2], ["b"])
    damage(a)
    outs = llm.generate([P1, P1, P2, P3], greedy(6), lora=["a", "a", "b", None])
    for o in outs[:2]:  # only the damaged adapter's requests fail, with the client's status
        assert o.finish_reason is FinishReason.ERROR and o.error_status == 400, o
        assert "'a' failed to load" in o.error and str(tmp_path) not in o.error
    assert [o.token_ids for o in outs[2:]] == [b_alone[0], before[2]]
    assert llm.engine.store.entries[llm.engine.store.names["a"]].last_error
    assert_idle(llm.engine)
    # the operator repairs the files and registers the name again: same answers as before
    shutil.rmtree(a)
    make_peft_adapter(tiny_model_dir, a, **spec)
    llm.unload_lora_adapter("a")
    llm.load_lora_adapter("a", str(a))
    assert gen(llm, [P1], ["a"]) == before[:1]
    assert_idle(llm.engine)


def test_reload_with_new_weights_while_old_requests_run(tiny_model_dir, tmp_path):
    v1 = make_peft_adapter(tiny_model_dir, tmp_path / "v1", r=8, seed=21)
    v2 = make_peft_adapter(tiny_model_dir, tmp_path / "v2", r=8, seed=22)
    alone = {v: LLM(str(tiny_model_dir), lora_paths={"x": str(p)})
             for v, p in (("v1", v1), ("v2", v2))}
    want = {v: gen(llm, [P1, P2], ["x", "x"], 12) for v, llm in alone.items()}
    assert want["v1"] != want["v2"]
    llm = LLM(str(tiny_model_dir), lora_paths={"x": str(v1)}, block_size=4)
    eng = llm.engine
    old = [eng.add_request(p, greedy(12), "x") for p in (P1, P2)]
    for _ in range(3):
        eng.step()
    llm.unload_lora_adapter("x")  # old requests drain on v1 ...
    llm.load_lora_adapter("x", str(v2))  # ... while the name serves v2 to new ones
    new = [eng.add_request(p, greedy(12), "x") for p in (P1, P2)]
    assert old[0].adapter_uid != new[0].adapter_uid
    outs = {}
    while eng.has_work:
        outs.update({o.request_id: o for o in eng.step() if o.finished})
        eng.check_invariants().raise_if_failed()
    assert [outs[r.request_id].token_ids for r in old] == want["v1"]
    assert [outs[r.request_id].token_ids for r in new] == want["v2"]
    assert_idle(eng)


def _serve(env_cache: Path, patch: str = "") -> subprocess.CompletedProcess:
    """`loraserve serve` (bundled model) with this cache directory; `patch` runs first."""
    code = (f"import sys\n{patch}\nfrom loraserve.cli import main\n"
            "sys.exit(main(['serve', '--port', '0']))")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "LORASERVE_CACHE": str(env_cache),
           "HOME": str(env_cache.parent)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120, cwd=REPO)


def test_unusable_or_full_cache_directory_is_one_clear_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    full = """
import errno
import loraserve.model.bundled as b
def _no_space(gguf, out):
    raise OSError(errno.ENOSPC, "No space left on device", str(out / "model.safetensors"))
b._convert = _no_space
"""
    for cache, patch, why in ((blocker / "cache", "", "Not a directory"),
                              (tmp_path / "cache", full, "No space left on device")):
        r = _serve(cache, patch)
        assert r.returncode == 2, (r.returncode, r.stderr)
        assert "Traceback" not in r.stderr, r.stderr
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("loraserve serve: the cache directory") and why in last
        assert "LORASERVE_CACHE" in last
    assert not list((tmp_path / "cache" / "models").glob(".*tmp-*")), "a half-written entry"


@pytest.mark.parametrize("lora_memory", ["tiered", "unified"])
def test_loading_while_host_memory_is_busy_registers_on_disk(tiny_model_dir, tmp_path,
                                                             lora_memory):
    # Found by the soak: with every host slot held by running requests a runtime load was a
    # 503, so a reload under traffic lost the name. Now it registers (validated) on disk.
    paths = {n: make_peft_adapter(tiny_model_dir, tmp_path / n, r=4, seed=40 + i)
             for i, n in enumerate("abc")}
    alone = LLM(str(tiny_model_dir), lora_paths={"c": str(paths["c"])})
    want = gen(alone, [P1], ["c"])
    llm = LLM(str(tiny_model_dir), lora_memory=lora_memory, max_loaded_loras=2,
              lora_paths={n: str(paths[n]) for n in "ab"})
    eng = llm.engine
    running = [eng.add_request(P2, greedy(8), n) for n in "ab"]
    eng.step()
    llm.load_lora_adapter("c", str(paths["c"]))
    store = eng.store
    assert store.entries[store.names["c"]].tier == "disk"
    eng.check_invariants().raise_if_failed()
    later = eng.add_request(P1, greedy(6), "c")
    outs = {}
    while eng.has_work:
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    assert all(outs[r.request_id].error is None for r in running)
    assert outs[later.request_id].token_ids == want[0]
    with pytest.raises(Exception, match="pinned or in use"):  # a pin needs host room now
        eng.add_request(P2, greedy(30), "a")
        eng.add_request(P2, greedy(30), "b")
        eng.step()
        llm.load_lora_adapter("p", str(paths["a"]), pinned=True)
    assert_idle_after(eng)


def assert_idle_after(eng):
    while eng.has_work:
        eng.step()
    assert_idle(eng)
