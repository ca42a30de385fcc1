"""The import graph of ``logitless.ops``, read from the source (every ``import``, at module level or
inside a function, except those under ``if TYPE_CHECKING:``, which only annotations read): no
circle, no backend sub-package reached from outside it (backends are
reached through the resolvers of the contracts, by ``importlib``), nothing imported from the
layers above ``ops`` (docs/architecture.md, rules)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import logitless.ops

OPS = Path(logitless.ops.__file__).parent
BACKENDS = ("torch_backend", "triton_backend", "flash_backend", "gemm_backend", "cute_backend")
ABOVE = ("objectives", "integrations", "cli", "bench", "demo", "refcache", "amp")


def _modules() -> dict[str, Path]:
    """``logitless.ops``' modules by dotted name (a package by its own name)."""
    out = {}
    for path in OPS.rglob("*.py"):
        parts = ("logitless", "ops", *path.relative_to(OPS).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The ``logitless`` modules that ``name`` imports (a name imported from a package counts as
    its submodule when it is one)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    tree = ast.parse(path.read_text())
    guarded = [b for b in ast.walk(tree)
               if isinstance(b, ast.If) and getattr(b.test, "id", getattr(b.test, "attr", "")) == "TYPE_CHECKING"]
    typing_only = {id(n) for block in guarded for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {m for m in found if m.startswith("logitless") and m != name}


@functools.cache
def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def _backend(name: str) -> str | None:
    return next((b for b in BACKENDS if f".{b}" in name), None)


def test_no_circle():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done
    circles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node] & graph.keys()):
            if state.get(nxt) == 1:
                circles.append(" -> ".join([*path[path.index(nxt):], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not circles, circles


def test_backends_reached_only_through_the_contracts():
    graph = _graph()
    assert {name for name in graph if _backend(name)} >= {f"logitless.ops.{b}.backend" for b in BACKENDS}
    crossing = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                      if _backend(b) and _backend(b) != _backend(a))
    assert not crossing, crossing


def test_nothing_from_above():
    upward = sorted(f"{a} -> {b}" for a, targets in _graph().items() for b in targets
                    if b.split(".")[1] in ABOVE)
    assert not upward, upward
