"""scripts/call_path.py: its counting rules on a two-file package, the structure of the traced
call path of each entry point (which files it passes, that the backward is traced, and that data
flows one way: ``ops/`` reaches ``objectives/`` only through the callbacks handed to it), and a
regression guard on ``policy_loss``'s counts (the numbers measured when issue 28's call-path work
ended: a change that lengthens the path must say so here)."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "call_path.py"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


call_path = _load("call_path", _SCRIPT)


def test_counting_rules(tmp_path):
    """A comprehension is part of its function, a generator counts once however often it is
    resumed, Python code outside the package is transparent, and the first call is an entry."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "outside.py").write_text(
        textwrap.dedent("""
        def apply(fn, xs):
            return [fn(x) for x in xs]
    """)
    )
    (tmp_path / "pkg" / "a.py").write_text(
        textwrap.dedent("""
        from outside import apply

        from .b import g, numbers

        def f(k):
            # g called from a comprehension (inside the package) and through a function outside it
            return [g(i) for i in range(k)] + apply(g, range(k)) + list(numbers(k))
    """)
    )
    (tmp_path / "pkg" / "b.py").write_text(
        textwrap.dedent("""
        def g(i):
            return _h(i)

        def _h(i):
            return i

        def numbers(k):
            yield from range(k)
    """)
    )
    (tmp_path / "pkg" / "__init__.py").write_text("")
    sys.path.insert(0, str(tmp_path))
    try:
        a = importlib.import_module("pkg.a")
        with call_path.Tracer(root=str(tmp_path / "pkg")) as tracer:
            a.f(3)
    finally:
        sys.path.remove(str(tmp_path))
        for name in ("pkg", "pkg.a", "pkg.b", "outside"):
            sys.modules.pop(name, None)
    path = tracer.path
    k = 3
    # f, 2k calls of g each calling _h, one start of numbers
    assert path.python_calls == 1 + 2 * k * 2 + 1
    assert [c.callee for c in path.entries] == ["f"]
    assert len(path.cross_file) == 2 * k + 1  # f -> g (from the comprehension and through apply), f -> numbers
    assert all(c.caller == "f" for c in path.cross_file)
    assert path.edges() == {("a.py", "b.py"): 2 * k + 1}
    assert path.files == ["a.py", "b.py"]


@pytest.mark.parametrize("function", call_path.ENTRY_POINTS)
def test_structure(function):
    path = call_path.measure(call_path.Case(function=function), chunks=1)
    files = set(path.files)
    assert "ops/engine.py" in files
    assert any(f.startswith("objectives/") for f in files)
    assert path.entries and path.entries[0].callee_file.startswith(("objectives/", "amp.py", "compile.py"))
    # Data flows one way: ops/ calls into objectives/ only through a function an outer layer handed it.
    upward = [
        c
        for c in path.calls
        if call_path.layer(c.caller_file) == "ops" and call_path.layer(c.callee_file) == "objectives"
    ]
    assert all(c.callback for c in upward), [f"{c.caller} -> {c.callee_file}::{c.callee}" for c in upward]
    # After the entry point, the only entry from outside the package is the autograd engine's call
    # into the pass's backward (an autograd.Function's, or one registered with a custom op).
    backward = path.entries[1:]
    if function == "token_logprobs":  # no gradient: nothing to trace after the forward
        assert not backward
    else:
        assert len(backward) == 1
        assert backward[0].callee_file.startswith("ops/") and "backward" in backward[0].callee


def test_policy_loss_chunks():
    """The fused policy loss hands ops/ its chunk objective, called once per chunk: the byte
    budget makes the chunks asked for, so the per-chunk increment measures chunks."""
    case = call_path.Case()
    assert "objectives/policy.py" in call_path.measure(case, 1).files
    for chunks in (1, 2):
        path = call_path.measure(case, chunks)
        # (besides the value checks it adds through ValueChecks.later, run when they are sent)
        callbacks = [c for c in path.calls if c.callback and c.caller != "ValueChecks.send"]
        assert len(callbacks) == chunks
        # LazyTokens.loss_term, which builds the PolicyTokens at the first chunk
        assert {c.callee_file for c in callbacks} == {"objectives/policy_terms.py"}


# policy_loss as measured at the end of issue 28's call-path work (docs/architecture.md): cross-file
# calls, files, and cross-file calls added by each extra chunk. Issue 28's targets: <= 45, <= 10, <= 8.
# 43: one more than at that work's end, the per-token tensors built at the first chunk's objective
# (LazyTokens.get), so that the host prepares them while the first statistics GEMM runs. 45: the
# first statistics GEMM started before the checks' read (engine.start_pass, which resolves the
# backend, and the read split into ValueChecks.send and PendingRead.wait around it). 47: the value
# checks read at the end of the call where the backend may run on unchecked values (the backend
# resolved for that, and the per-token checks added through ValueChecks.later, run by send). 49:
# the first statistics GEMM started in two parts, before the checks are built and after the send
# (a second engine.start_pass, which resolves the backend again).
_POLICY_LOSS_PATH = {"cross_file_calls": 49, "files": 10, "per_extra_chunk": 5}


def test_policy_loss_path_does_not_grow():
    case = call_path.Case()
    paths = {chunks: call_path.measure(case, chunks) for chunks in (1, 2, 3)}
    calls = {chunks: len(path.cross_file) for chunks, path in paths.items()}
    assert calls[1] <= _POLICY_LOSS_PATH["cross_file_calls"], paths[1].edges()
    assert len(paths[1].files) <= _POLICY_LOSS_PATH["files"], paths[1].files
    assert calls[2] - calls[1] <= _POLICY_LOSS_PATH["per_extra_chunk"]
    assert calls[3] - calls[2] <= _POLICY_LOSS_PATH["per_extra_chunk"]


def test_cli_json(tmp_path, capsys):
    out = tmp_path / "path.json"
    data = call_path.main(["--function", "token_logprobs", "--json", str(out), "--top", "3"])
    assert out.exists() and "cross-file calls" in capsys.readouterr().out
    by = data["by_chunks"]
    assert set(by) == {"1", "2", "3"}
    assert by["1"]["files"] == len(data["files"]) == len(data["per_file"])
    assert sum(e["calls"] for e in data["edges"]) == by["1"]["cross_file_calls"]
