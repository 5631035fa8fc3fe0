"""Run a check in a process of its own whose C kernels are built for AVX2 (`-march=x86-64-v3`,
as an AVX2-only host builds them): a test hands it a script, the script's arguments, and the
word the script prints when every check passed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def assert_passes_on_avx2(script: str, *args: object, passed: str = "ok") -> None:
    # tests/ on the path, as pytest puts it, for the helpers a test module imports
    path = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "LORASERVE_CPU_ARCH": "x86-64-v3", "PYTHONPATH": path}
    out = subprocess.run([sys.executable, "-c", script, *map(str, args)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and passed in out.stdout, out.stderr[-3000:]
