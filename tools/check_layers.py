"""The layer check: imports inside the loraserve package go one way, down the layer order.

    python tools/check_layers.py [ROOT] [--strict]

Reads every loraserve/**/*.py under ROOT (default: this checkout) with `ast`; imports inside
functions count too. Imports under `if TYPE_CHECKING:` count only with --strict, the mode the
test suite runs: a type-only import still ties two modules' designs together. Prints every
import cycle between modules and every import that goes up the layer order, then one summary
line; exits 0 only when there are none. The layer order is docs/design.md's (§2).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# (module prefix, rank): a module may import from its own rank or below. The longest matching
# prefix wins; "loraserve" alone (the package __init__, which re-exports) is a composition root.
LAYERS: tuple[tuple[str, int], ...] = (
    ("loraserve.types", 0), ("loraserve.config", 0), ("loraserve.paths", 0),
    ("loraserve.errors", 0),
    ("loraserve.ops", 1), ("loraserve.request", 1), ("loraserve.kvcache", 1),
    ("loraserve.lora", 2), ("loraserve.adapters.format", 2), ("loraserve.adapters.peft", 2),
    ("loraserve.model", 3), ("loraserve.adapters", 3),
    ("loraserve.scheduler", 4),
    ("loraserve.engine", 5),
    ("loraserve.server", 6), ("loraserve.bench", 6),
    ("loraserve.cluster", 7),
    ("loraserve.demo", 8),
    ("loraserve.cli", 9), ("loraserve.readme_flags", 9), ("loraserve", 9),
    ("loraserve.demo.__main__", 10), ("loraserve.__main__", 10),
)


@dataclass(frozen=True)
class Report:
    modules: int
    cycles: list[list[str]]
    upward: list[tuple[str, str]]

    @property
    def ok(self) -> bool:
        return not self.cycles and not self.upward


def rank(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (prefix length, rank)
    for prefix, r in LAYERS:
        if (module == prefix or module.startswith(prefix + ".")) and (
                best is None or len(prefix) > best[0]):
            best = (len(prefix), r)
    return None if best is None else best[1]


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_only_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def imported(path: Path, module: str, strict: bool) -> Iterator[str]:
    """The loraserve modules (or attributes of them) that `path` imports."""
    tree = ast.parse(path.read_text(), str(path))
    skip = set() if strict else _type_only_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.split(".")[0] == "loraserve")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: climb level - 1 packages from this one
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            if base.split(".")[0] == "loraserve":
                yield base
                # `from pkg import mod` imports the module pkg.mod where it exists
                yield from (f"{base}.{a.name}" for a in node.names)


def import_graph(root: Path, strict: bool) -> dict[str, set[str]]:
    files = {module_name(root, p): p for p in sorted((root / "loraserve").rglob("*.py"))}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        for target in imported(path, module, strict):
            while target and target not in files:  # an attribute: its module
                target = target.rpartition(".")[0]
            if target and target != module:
                graph[module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    # the package root and its __main__ import each other's names lazily by design
    return sorted(c for c in found if not all(m == "loraserve" or m.startswith("loraserve.__")
                                              for m in c))


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    up = []
    for module, targets in graph.items():
        for target in targets:
            rm, rt = rank(module), rank(target)
            # a module may read its own package's __init__, and the package root re-exports
            inside = module.startswith(target + ".")
            if rm is not None and rt is not None and rt > rm and not inside:
                up.append((module, target))
    return sorted(up)


def check(root: Path, strict: bool = False) -> Report:
    graph = import_graph(root, strict)
    return Report(len(graph), cycles(graph), upward_imports(graph))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", nargs="?", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--strict", action="store_true", help="count TYPE_CHECKING imports too")
    args = ap.parse_args(argv)
    report = check(args.root, args.strict)
    for component in report.cycles:
        print("  cycle:", " <-> ".join(component))
    for module, target in report.upward:
        print(f"  upward: {module} -> {target}")
    print(f"layers: {report.modules} modules, {len(report.cycles)} import cycles, "
          f"{len(report.upward)} upward imports")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
