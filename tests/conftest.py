"""Shared pytest fixtures. Models are built once per session; tests must not modify them.

Tests live by kind: unit/ (no model or a stub), kernels/ (C and Triton ops against their
references), engine/ (the engine on tiny or bundled models), server/ (real HTTP servers),
cluster/ (Ray Serve), gpu/ (the engine on a CUDA GPU; skipped without one). Each test gets
its folder's name as a marker, and tests that use hypothesis get `property`, so
`make test-fast` can leave out servers, Ray and fuzzing. The
Makefile runs the suite on two pytest-xdist workers.
pyproject.toml puts tests/ on sys.path, so helpers such as `model_factory` import directly.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

# Without a GPU the triton kernels run on this CPU under Triton's interpreter; triton reads the
# switch when a kernel is defined, so it must be set before anything imports triton. With one,
# they are compiled for it (the gpu tier, tests/gpu).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from model_factory import make_tiny_llama  # noqa: E402

KINDS = ("unit", "kernels", "engine", "server", "cluster", "gpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        kind = Path(str(item.fspath)).parent.name
        if kind in KINDS:
            item.add_marker(kind)
        if _uses_hypothesis(item.module):
            item.add_marker("property")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under pytest-xdist (`-n 2`, the Makefile's): a module's tests stay on one worker, so a
    module-scoped server starts once, and the cluster tests share one worker, so only one
    local Ray instance runs at a time. Other --dist modes are xdist's own."""
    if config.getvalue("dist") not in ("load", "loadfile"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "tests/cluster" if path.startswith("tests/cluster/") else path

    return ByModule(config, log)


def _uses_hypothesis(module) -> bool:
    return any(
        (getattr(value, "__module__", None) or "").startswith("hypothesis")
        for value in vars(module).values()
    )


# ---- base models -----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random 2-layer Llama, untied embeddings, GQA (4 query / 2 kv heads), vocab 512."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_tied_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Like tiny_model_dir but with tied input/output embeddings (no lm_head.weight saved)."""
    return make_tiny_llama(
        tmp_path_factory.mktemp("tiny_llama_tied"), tie_word_embeddings=True, seed=1
    )


@pytest.fixture(scope="session")
def tiny_sharded_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same weights as tiny_model_dir, saved as several safetensors shards plus an index."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama_sharded"), sharded=True)


@pytest.fixture(scope="session")
def bundled_model_dir() -> Path:
    """The bundled SmolLM2-135M-Instruct checkpoint (converted once into the user cache)."""
    from loraserve.model.bundled import default_model_dir

    return default_model_dir()


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    # Tiny matmuls on 2 cores: one intra-op thread is faster than two, and avoids OpenMP
    # spin-waiting against the server subprocesses the end-to-end tests start.
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
