"""Run a benchmark script on an older commit and on the working tree, alternating, same machine.

Each round runs the script once in a worktree of REV and once in this checkout (order flips
every round, so drift hits both), each in a fresh process with the same venv, and reads the
JSON each run writes to its tree's docs/bench-results/. Prints every round's figures and the
median per side. For refactors that must not cost speed.

    .venv/bin/python tools/compare_commits.py --rev 92fb225 --rounds 2 \
        --script benchmarks/offline_throughput.py --result offline_throughput -- --reps 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def flat(d: dict, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a nested result, with dotted keys."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        elif isinstance(v, int | float) and not isinstance(v, bool):
            out[prefix + k] = float(v)
    return out


def run_once(tree: Path, script: str, result: str, extra: list[str]) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    subprocess.run([sys.executable, str(tree / script), *extra], cwd=tree, env=env, check=True)
    return flat(json.loads((tree / "docs" / "bench-results" / f"{result}.json").read_text()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", required=True, help="the older commit")
    ap.add_argument("--script", required=True, help="benchmark script, relative to the root")
    ap.add_argument("--result", required=True, help="its docs/bench-results/NAME.json")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--keys", nargs="*", default=None, help="figures to print (default: all)")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="after --: the script's arguments")
    args = ap.parse_args()
    extra = [a for a in args.extra if a != "--"]
    old = Path(tempfile.mkdtemp(prefix="loraserve-rev-"))
    subprocess.run(["git", "worktree", "add", "--detach", str(old), args.rev], cwd=ROOT,
                   check=True, capture_output=True)
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    try:
        for i in range(args.rounds):
            order = [("before", old), ("after", ROOT)]
            for side, tree in order if i % 2 == 0 else order[::-1]:
                print(f"--- round {i}: {side} ({tree})", flush=True)
                runs[side].append(run_once(tree, args.script, args.result, extra))
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT)
    keys = args.keys or sorted(set(runs["before"][0]) & set(runs["after"][0]))
    summary = {}
    print(f"\n{'figure':40s} {'before':>10s} {'after':>10s} {'after/before':>13s}")
    for k in keys:
        b = statistics.median(r[k] for r in runs["before"])
        a = statistics.median(r[k] for r in runs["after"])
        summary[k] = {"before": b, "after": a, "rounds_before": [r[k] for r in runs["before"]],
                      "rounds_after": [r[k] for r in runs["after"]]}
        print(f"{k:40s} {b:10.3f} {a:10.3f} {a / b if b else float('nan'):13.3f}")
    out = ROOT / "docs" / "bench-results" / f"compare-{args.result}.json"
    out.write_text(json.dumps({"rev": args.rev, "script": args.script, "args": extra,
                               "rounds": args.rounds, "figures": summary}, indent=2))
    print("wrote", out)


if __name__ == "__main__":
    main()
