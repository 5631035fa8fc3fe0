"""Runtime adapter load/unload over HTTP on the real server: idempotency and conflicts, every
bad adapter is a clear 4xx that changes nothing, --lora-root confinement, implicit eviction and
reload with identical outputs, pinning."""

from __future__ import annotations

import os
import shutil

import pytest
from adapter_factory import edit_config, make_peft_adapter, to_pickle, truncate_weights
from model_factory import make_tiny_llama
from server_utils import ServerProcess, assert_error

PROMPTS = ["hello world", "the cat reads a table"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("server_adapters")
    model = make_tiny_llama(root / "model")
    lroot = root / "loras"
    out = {"root": root, "model": model, "lroot": lroot, "outside": root / "outside"}
    for i, name in enumerate(["e1", "e2", "e3", "p"]):
        out[name] = make_peft_adapter(model, lroot / name, r=4 + i, seed=10 + i,
                                      target_modules=["q_proj", "v_proj", "gate_proj"])
    out["big"] = make_peft_adapter(model, lroot / "big", r=32, seed=3)
    shutil.copytree(out["e1"], out["outside"])
    return out


@pytest.fixture(scope="module")
def server(files):
    with ServerProcess(files["model"], "--allow-runtime-lora-updates", "--lora-root",
                       str(files["lroot"]), "--max-loaded-loras", "2", "--max-lora-rank", "16",
                       "--max-loras-per-batch", "3", log_dir=files["root"]) as s:
        yield s


@pytest.fixture(scope="module")
def refs(files):
    """Offline greedy outputs per (adapter, prompt), all adapters resident (no eviction)."""
    from loraserve import LLM, SamplingParams

    names = ["e1", "e2", "e3", "p"]
    llm = LLM(files["model"], lora_paths={n: str(files[n]) for n in names})
    sp = SamplingParams(max_tokens=10, temperature=0.0)
    return {(n, p): llm.generate(p, sp, lora=n)[0].text for n in names for p in PROMPTS}


def load(server, name, path, **kw):
    return server.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path), **kw})


def unload(server, name):
    return server.post("/v1/unload_lora_adapter", {"lora_name": name})


def complete(server, model, prompt):
    r = server.post("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 10,
                                        "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def tiers(server) -> dict:
    return {m["id"]: (m["tier"], m["pinned"]) for m in server.get("/v1/models").json()["data"]
            if m["parent"]}


def test_load_use_unload(server, files, refs):
    r = load(server, "e1", files["e1"])
    assert r.status_code == 200 and r.json()["loaded_adapters"] == {"e1": str(files["e1"])}
    assert load(server, "e1", files["e1"]).status_code == 200  # same path: idempotent
    relative = load(server, "e1", "e1")  # relative to --lora-root: the same directory
    assert relative.status_code == 200
    assert_error(load(server, "e1", files["e2"]), 409, "already loaded")
    assert complete(server, "e1", PROMPTS[0]) == refs[("e1", PROMPTS[0])]
    r = unload(server, "e1")
    assert r.status_code == 200 and "e1" not in r.json()["loaded_adapters"]
    assert_error(server.post("/v1/completions", {"model": "e1", "prompt": "x"}), 404)
    assert_error(unload(server, "e1"), 404, "not loaded")
    assert server.post("/load_lora_adapter", {"lora_name": "e1",  # the path without /v1 too
                                              "lora_path": str(files["e1"])}).status_code == 200
    assert server.post("/unload_lora_adapter", {"lora_name": "e1"}).status_code == 200
    server.wait_idle()


def test_unload_while_in_flight_drains(server, files):
    import httpx

    assert load(server, "e2", files["e2"]).status_code == 200
    body = {"model": "e2", "prompt": "hi", "max_tokens": 300, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        next(lines)
        assert unload(server, "e2").status_code == 200  # unregistered now, freed on drain
        assert "e2" not in tiers(server)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    state = server.wait_idle()
    assert "e2" not in [a["name"] for a in state["adapters"]]


def broken(files, how):
    target = files["lroot"] / f"bad_{how}"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(files["e3"], target)
    {"corrupt": truncate_weights, "pickle": to_pickle,
     "r0": lambda p: edit_config(p, r=0),
     "module": lambda p: edit_config(p, target_modules=["q_proj", "mlp.fc1"])}[how](target)
    return target


@pytest.mark.parametrize("how,fragment", [
    ("corrupt", "corrupt or truncated"), ("pickle", "pickle"),
    ("r0", "r must be a positive integer"), ("module", "target module 'mlp.fc1'")])
def test_bad_adapter_is_a_clear_400_and_changes_nothing(server, files, how, fragment):
    before = tiers(server)
    assert_error(load(server, f"bad_{how}", broken(files, how)), 400, fragment)
    assert tiers(server) == before
    assert complete(server, "model", "hello")  # still serving


def test_more_bad_loads(server, files):
    before = tiers(server)
    assert_error(load(server, "nope", files["lroot"] / "missing"), 400, "does not exist")
    assert_error(load(server, "big", files["big"]), 400, "max_lora_rank=16")
    assert_error(load(server, "a:b", files["e1"]), 400, "invalid adapter name")
    assert_error(load(server, "a/b", files["e1"]), 400, "invalid adapter name")
    assert_error(server.post("/v1/load_lora_adapter", {"lora_name": "x"}), 400, "lora_path")
    assert_error(server.post("/v1/load_lora_adapter", content=b"{nope"), 400, "JSON")
    # --lora-root confinement: outside, '..', and a symlink inside pointing outside.
    assert_error(load(server, "out", files["outside"]), 403, "--lora-root")
    assert_error(load(server, "out", "../outside"), 403, "'..'")
    link = files["lroot"] / "escape"
    if not link.exists():
        os.symlink(files["outside"], link)
    assert_error(load(server, "out", link), 403, "outside the allowed directory")
    assert_error(load(server, "out", "escape"), 403, "outside the allowed directory")
    assert tiers(server) == before
    assert server.get("/health").status_code == 200
    assert server.state()["engine_errors"] == 0


def test_implicit_eviction_and_reload_give_identical_outputs(server, files, refs):
    for name in ("e1", "e2", "e3"):  # max_loaded_loras=2: the third evicts the LRU one
        assert load(server, name, files[name]).status_code == 200
    t = tiers(server)
    assert t["e1"][0] == "disk" and t["e2"][0] != "disk" and t["e3"][0] != "disk", t
    for _ in range(2):  # round-robin over 3 adapters with room for 2: every use may reload
        for name in ("e1", "e2", "e3"):
            for p in PROMPTS:
                assert complete(server, name, p) == refs[(name, p)], name
            t = tiers(server)
            assert t[name][0] != "disk" and sum(v[0] == "disk" for v in t.values()) == 1, t
    metrics = server.get("/metrics").text
    assert 'loraserve_adapter_loads_total{adapter="e1"} 3.0' in metrics, metrics
    log = server.log()
    assert "evicted from host memory" in log and "reloaded into host memory" in log
    for name in ("e1", "e2", "e3"):
        assert unload(server, name).status_code == 200
    server.wait_idle()


def test_pinned_adapter_survives(server, files, refs):
    assert load(server, "p", files["p"], pinned=True).status_code == 200
    for name in ("e1", "e2", "e3"):
        assert load(server, name, files[name]).status_code == 200
        assert tiers(server)["p"][0] != "disk"
    for name in ("e1", "e2", "e3", "p"):
        assert complete(server, name, PROMPTS[0]) == refs[(name, PROMPTS[0])]
        t = tiers(server)
        assert t["p"][0] != "disk" and t["p"][1] is True, t
    state = {a["name"]: a for a in server.wait_idle()["adapters"]}
    assert state["p"]["pinned"] and state["p"]["tier"] != "disk"
    metrics = server.get("/metrics").text
    assert 'loraserve_adapter_host_evictions_total{adapter="p"} 0.0' in metrics
    for name in ("e1", "e2", "e3", "p"):
        assert unload(server, name).status_code == 200
    assert tiers(server) == {}
    assert 'adapter="e1"' not in server.get("/metrics").text  # series of unloaded adapters go


def test_dora_and_vocabulary_adapters_load_at_runtime_and_other_kinds_get_a_4xx(server, files):
    # The runtime load reads the adapter off the engine thread; DoRA's norms need the base
    # model's weights there too. Outputs equal the offline engine's (itself equal to PEFT's:
    # tests/engine/test_adapter_kinds.py); a VeRA adapter is refused naming its kind.
    import peft
    from adapter_factory import load_base_model

    from loraserve import LLM, SamplingParams

    lroot, model = files["lroot"], files["model"]
    kinds = {"dora": dict(use_dora=True, target_modules=["q_proj", "down_proj"]),
             "vocab": dict(target_modules=["embed_tokens", "lm_head", "v_proj"]),
             "copies": dict(target_modules=["q_proj"], modules_to_save=["lm_head"])}
    paths = {n: make_peft_adapter(model, lroot / n, r=4, seed=20 + i, init_scale=1.0, **kw)
             for i, (n, kw) in enumerate(kinds.items())}
    llm = LLM(model, lora_paths={n: str(p) for n, p in paths.items()})
    sp = SamplingParams(max_tokens=10, temperature=0.0)
    for name, path in paths.items():
        assert load(server, name, path).status_code == 200
        want = llm.generate(PROMPTS[1], sp, lora=name)[0].text
        assert complete(server, name, PROMPTS[1]) == want, name
        assert unload(server, name).status_code == 200
    vera = peft.get_peft_model(load_base_model(model), peft.VeraConfig(
        r=4, target_modules=["q_proj", "v_proj"]))
    vera.save_pretrained(lroot / "vera")
    assert_error(load(server, "vera", lroot / "vera"), 400, "VeRA")
    assert "vera" not in tiers(server)
    server.wait_idle()
