"""Run one benchmark script on this host's native ISA and on imitated AVX2, side by side.

    .venv/bin/python tools/both_isas.py offline_throughput [script args...]

SCRIPT names a script of benchmarks/ (or benchmarks/kernels/) that writes its result with
common.write_result. AVX2 is imitated (docs/design.md §5) with ATEN_CPU_CAPABILITY=avx2,
ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2 and our C kernels built for
-march=x86-64-v3. The script runs twice, native then AVX2 (each compares loraserve with its
reference inside its own run), and writes docs/bench-results/SCRIPT-native.json and
SCRIPT-avx2.json; every number the two have in common is printed side by side. On a host
without AVX-512 both runs are AVX2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "bench-results"

AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2", "LORASERVE_CPU_ARCH": "x86-64-v3"}
ISAS = {"native": {}, "avx2": AVX2}


def flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        elif isinstance(v, int | float | str) and not isinstance(v, bool):
            out[prefix + k] = v
    return out


def script_path(name: str) -> Path:
    for folder in ("benchmarks", "benchmarks/kernels"):
        path = ROOT / folder / f"{name}.py"
        if path.exists():
            return path
    sys.exit(f"no benchmark script {name}.py in benchmarks/ or benchmarks/kernels/")


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    script, args = Path(sys.argv[1]).name.removesuffix(".py"), sys.argv[2:]
    path = script_path(script)
    results = {}
    for tag, env in ISAS.items():
        print(f"==== {script} on {tag} ====", flush=True)
        run_env = {**os.environ, **env, "LORASERVE_BENCH_TAG": tag}
        # the file the script wrote (a workload's options can change its name): its "wrote" line
        wrote = RESULTS / f"{script}-{tag}.json"
        with subprocess.Popen([sys.executable, str(path), *args], env=run_env,
                              stdout=subprocess.PIPE, text=True) as proc:
            for line in proc.stdout:
                print(line, end="", flush=True)
                if line.startswith("wrote "):
                    wrote = Path(line.removeprefix("wrote ").strip())
        if proc.returncode:
            sys.exit(f"{script} failed on {tag} (exit status {proc.returncode})")
        results[tag] = flat(json.loads(wrote.read_text()))
    print(f"\n{'':44s}{'native':>16s}{'avx2':>16s}")
    for key in results["native"]:
        if key in results["avx2"] and not key.startswith("workload"):
            a, b = results["native"][key], results["avx2"][key]
            fmt = (lambda x: f"{x:16.3f}") if isinstance(a, float) else (lambda x: f"{x!s:>16}")
            print(f"{key[:44]:44s}{fmt(a)}{fmt(b)}")


if __name__ == "__main__":
    main()
