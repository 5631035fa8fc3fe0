"""The package keeps its layer order (docs/design.md §2): tools/check_layers.py, run in its
strict mode (type-only imports count), finds no import cycle and no upward import."""

from __future__ import annotations

import subprocess
import sys

from server_utils import REPO

CHECK = REPO / "tools" / "check_layers.py"


def test_no_cycles_and_no_upward_imports_counting_type_only_imports():
    proc = subprocess.run([sys.executable, str(CHECK), str(REPO), "--strict"],
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip().endswith("0 import cycles, 0 upward imports"), proc.stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_check_sees_a_cycle_and_an_upward_import(tmp_path):
    """The check can fail: a scheduler module importing the engine, which imports it back."""
    pkg = tmp_path / "loraserve"
    for sub in ("scheduler", "engine"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "scheduler" / "rules.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from loraserve.engine.step import Step\n")
    (pkg / "engine" / "step.py").write_text("from loraserve.scheduler import rules\n")
    loose = subprocess.run([sys.executable, str(CHECK), str(tmp_path)], capture_output=True,
                           text=True, timeout=60)
    assert loose.returncode == 0, loose.stdout  # type-only imports count only when strict
    strict = subprocess.run([sys.executable, str(CHECK), str(tmp_path), "--strict"],
                            capture_output=True, text=True, timeout=60)
    assert strict.returncode == 1
    assert "cycle: loraserve.engine.step <-> loraserve.scheduler.rules" in strict.stdout
    assert "upward: loraserve.scheduler.rules -> loraserve.engine.step" in strict.stdout
