"""The Python call path of one logitless call, counted inside the package (issue 28's measure).

Runs one call of an entry point (``policy_loss`` by default) on small random CPU inputs, forward
and ``loss.backward()``, under ``sys.setprofile``, once with one token chunk and again with a
byte budget that cuts the tokens into 2 and 3 chunks, and prints how many calls cross from one
source file of the package to another.

    PYTHONPATH=src python scripts/call_path.py                 # policy_loss, the issue's numbers
    PYTHONPATH=src python scripts/call_path.py --function cross_entropy --json out.json
    PYTHONPATH=src python scripts/call_path.py --sequence      # every cross-file call, in order

The case: fp32, ``PassOptions(mode="fused", impl="torch")``, ``PolicyConfig()`` (TRL's GRPO
defaults), 4 sequences of 32 positions with 24 counted (96 tokens), hidden size 16, vocabulary
64, seed 0; ``cross_entropy``/``vocab_stats``/``token_logprobs`` get the same rows with the
padding as ``ignore_index``. ``token_logprobs`` runs no backward (it takes no gradient). The call
is made once untraced first, so imports, cached settings and lazy initialisation are not counted:
the numbers are those of a steady-state training step.

What is counted (so that the numbers can be reproduced):

* **Package code**: code objects whose file lies under the imported ``logitless`` package's
  directory. Everything else (torch, the standard library, code that ``dataclasses`` and
  ``NamedTuple`` generate from strings) is not counted and is transparent: a call that reaches
  package code through torch (``autograd.Function.apply``, ``torch.autograd.grad``) is
  attributed to the nearest package frame below it.
* **Python call**: one ``call`` profile event into package code: every function, method,
  property, lambda, nested function and wrapper that runs. Not counted: comprehensions and
  generator expressions (Python 3.12 inlines the former; both are part of the enclosing
  function, which they are transparent to), a generator's resumptions after its first start, and
  module bodies.
* **Caller**: the nearest counted package frame below the callee. A call with none (the user's
  call into the package, and the autograd engine's call into an ``autograd.Function.backward``
  during ``loss.backward()``) is an **entry**; entries are listed apart and are not cross-file
  calls, but everything they run is counted.
* **Cross-file call**: a Python call whose caller's file differs from the callee's file.
* **Files**: the distinct package files with a counted call (as callee or as an entry).
* **Per extra chunk**: cross-file calls with 2 chunks minus with 1, and with 3 minus with 2.
* **Layer switches**: the Python calls in order, each labelled by the top-level folder of its
  callee's file, keeping only ``objectives`` and ``ops`` labels; the number of neighbours whose
  labels differ, within each entry's calls (each hand-over of control between the two folders,
  a call or a return into the other, counts once; the autograd engine's call into the backward
  does not).
* **Callback**: a call from ``ops/`` into a function that an outer layer handed to ``ops/``
  (an argument of a call into ``ops/``, or a field of a dataclass or named tuple given as one:
  the chunk objective, ``ObjectiveSpec.before_loss``).

CPU only: on CPU the autograd engine runs ``backward`` on the calling thread, which
``sys.setprofile`` sees.
"""

from __future__ import annotations

import argparse
import dataclasses
import dis
import json
import math
import os
import sys
import types
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise

import torch

ENTRY_POINTS = ("policy_loss", "cross_entropy", "token_logprobs", "vocab_stats")
_COMPREHENSIONS = frozenset({"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"})
_GENERATOR_FLAGS = 0x20 | 0x80 | 0x200  # CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR
_OUTSIDE = "<outside>"
_LAYERS = ("objectives", "ops")


@dataclass(frozen=True)
class Call:
    """One Python call into package code. Files are relative to the package directory
    (``ops/engine.py``); ``caller_file`` is :data:`_OUTSIDE` for an entry."""

    caller_file: str
    caller: str  # qualified name of the calling function ('' for an entry)
    callee_file: str
    callee: str
    callback: bool = False  # a function an outer layer handed to ops/, called from ops/

    @property
    def cross_file(self) -> bool:
        return self.caller_file != _OUTSIDE and self.caller_file != self.callee_file

    @property
    def entry(self) -> bool:
        return self.caller_file == _OUTSIDE


def layer(path: str) -> str:
    """The top-level folder of a package file (``ops``, ``objectives``, ...), or ``core`` for a
    module at the package's top (``amp.py``, ``compile.py``)."""
    return path.split("/", 1)[0] if "/" in path else "core"


@dataclass
class CallPath:
    """The counted calls of one traced call, in call order, and the measures of them."""

    calls: list[Call] = field(default_factory=list)

    @property
    def python_calls(self) -> int:
        return len(self.calls)

    @property
    def cross_file(self) -> list[Call]:
        return [c for c in self.calls if c.cross_file]

    @property
    def files(self) -> list[str]:
        return sorted({c.callee_file for c in self.calls})

    @property
    def entries(self) -> list[Call]:
        return [c for c in self.calls if c.entry]

    @property
    def layer_switches(self) -> int:
        switches, labels = 0, []
        for c in [*self.calls, None]:
            if c is None or c.entry:  # an entry starts a new run of calls: the backward is not a switch
                switches += sum(a != b for a, b in pairwise(labels))
                labels = []
            if c is not None and layer(c.callee_file) in _LAYERS:
                labels.append(layer(c.callee_file))
        return switches

    def edges(self) -> Counter[tuple[str, str]]:
        """Cross-file calls per ``(caller file, callee file)``."""
        return Counter((c.caller_file, c.callee_file) for c in self.cross_file)

    def per_file(self) -> dict[str, dict[str, int]]:
        """Per file: Python calls into it, cross-file calls into it and out of it."""
        out = {f: {"calls": 0, "cross_in": 0, "cross_out": 0} for f in self.files}
        for c in self.calls:
            out[c.callee_file]["calls"] += 1
            if c.cross_file:
                out[c.callee_file]["cross_in"] += 1
                out[c.caller_file]["cross_out"] += 1
        return out

    def summary(self) -> dict:
        return {
            "cross_file_calls": len(self.cross_file),
            "files": len(self.files),
            "python_calls": self.python_calls,
            "layer_switches": self.layer_switches,
            "entries": [f"{c.callee_file}::{c.callee}" for c in self.entries],
            "callbacks": len([c for c in self.calls if c.callback]),
        }


class Tracer:
    """``with Tracer() as t: ...`` records the package calls made inside the block in ``t.path``
    (see the module docstring for what is counted). Not reentrant; one thread."""

    def __init__(self, root: str | None = None):
        if root is None:
            import logitless

            root = os.path.dirname(logitless.__file__)
        self.root = os.path.realpath(root) + os.sep
        self.path = CallPath()
        self._files: dict[types.CodeType, str | None] = {}
        self._starts: dict[types.CodeType, frozenset[int]] = {}
        self._handed: set[types.CodeType] = set()  # code of functions handed to ops/ by an outer layer
        self._previous: Callable | None = None

    def __enter__(self) -> Tracer:
        self._previous = sys.getprofile()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(self._previous)

    def _file(self, code: types.CodeType) -> str | None:
        """``code``'s file relative to the package, or ``None`` outside it."""
        try:
            return self._files[code]
        except KeyError:
            path = os.path.realpath(code.co_filename)
            rel = path[len(self.root) :].replace(os.sep, "/") if path.startswith(self.root) else None
            self._files[code] = rel
            return rel

    def _counted(self, frame: types.FrameType) -> str | None:
        """The package file of a frame that counts as a function (see the module docstring)."""
        code = frame.f_code
        rel = self._file(code)
        if rel is None or code.co_name in _COMPREHENSIONS or code.co_name == "<module>":
            return None
        return rel

    def _first_start(self, frame: types.FrameType) -> bool:
        """Whether a generator frame's ``call`` event is its first start, not a resumption."""
        code = frame.f_code
        starts = self._starts.get(code)
        if starts is None:
            # From 3.11 a generator starts at a RESUME with argument 0 and resumes at one with an
            # argument; before, an unstarted frame has f_lasti -1.
            starts = frozenset(i.offset for i in dis.get_instructions(code) if i.opname == "RESUME" and i.arg == 0)
            self._starts[code] = starts
        return frame.f_lasti in starts if starts else frame.f_lasti < 0

    def _hand_over(self, frame: types.FrameType) -> None:
        """Remember the functions an outer layer hands to ``ops/`` in a call's arguments."""
        code = frame.f_code
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        for name in names:
            value = frame.f_locals.get(name)
            values = [value]
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                values += [getattr(value, f.name) for f in dataclasses.fields(value)]
            elif isinstance(value, tuple) and hasattr(value, "_fields"):
                values += list(value)
            for v in values:
                code_of = getattr(v, "__code__", None)
                if isinstance(code_of, types.CodeType):
                    self._handed.add(code_of)

    def _profile(self, frame: types.FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        callee_file = self._counted(frame)
        if callee_file is None:
            return
        code = frame.f_code
        if code.co_flags & _GENERATOR_FLAGS and not self._first_start(frame):
            return
        up = frame.f_back
        while up is not None and self._counted(up) is None:
            up = up.f_back
        caller_file = _OUTSIDE if up is None else self._counted(up)
        caller = "" if up is None else _qualname(up.f_code)
        callee_layer, caller_layer = layer(callee_file), layer(caller_file) if up is not None else _OUTSIDE
        if callee_layer == "ops" and caller_layer != "ops":
            self._hand_over(frame)
        callback = caller_layer == "ops" and callee_layer != "ops" and code in self._handed
        self.path.calls.append(Call(caller_file, caller, callee_file, _qualname(code), callback))


def _qualname(code: types.CodeType) -> str:
    return getattr(code, "co_qualname", code.co_name)


# ----------------------------------------------------------------------------- the measured case


@dataclass(frozen=True)
class Case:
    """The traced call's inputs: ``batch`` sequences of ``length`` positions, the first
    ``counted`` of each counted, hidden size ``hidden_size``, vocabulary ``vocab``."""

    function: str = "policy_loss"
    batch: int = 4
    length: int = 32
    counted: int = 24
    hidden_size: int = 16
    vocab: int = 64
    seed: int = 0

    @property
    def tokens(self) -> int:
        return self.batch * self.counted


def _bytes_per_logit() -> int:
    """Workspace bytes per logit element of the torch backend in fp32 (the engine's own rule)."""
    try:
        from logitless.ops.plan import workspace_per_element
    except ImportError:  # the rule moved: 3 fp32 arrays plus dz in the input dtype
        return 16
    return workspace_per_element(torch.float32, torch.float32, "torch")


def options_for(case: Case, chunks: int):
    """Fused, torch backend, with a byte budget that cuts ``case``'s tokens into ``chunks``
    chunks (the default budget for one)."""
    from logitless import PassOptions

    budget = None
    if chunks > 1:
        budget = math.ceil(case.tokens / chunks) * case.vocab * _bytes_per_logit()
    return PassOptions(mode="fused", impl="torch", chunk_bytes=budget)


def make_call(case: Case, chunks: int) -> Callable[[], object]:
    """A function that makes ``case``'s call with ``chunks`` chunks, forward and backward."""
    import logitless

    if case.function not in ENTRY_POINTS:
        raise ValueError(f"function must be one of {ENTRY_POINTS}, got {case.function!r}")
    g = torch.Generator().manual_seed(case.seed)
    b, t, h, v = case.batch, case.length, case.hidden_size, case.vocab
    hidden = torch.randn(b, t, h, generator=g)
    weight = (torch.randn(v, h, generator=g) / h**0.5).requires_grad_()
    ids = torch.randint(0, v, (b, t), generator=g)
    mask = torch.zeros(b, t, dtype=torch.long)
    mask[:, : case.counted] = 1
    options = options_for(case, chunks)

    def call():
        x = hidden.clone().requires_grad_()
        weight.grad = None
        if case.function == "policy_loss":
            advantages = torch.randn(b, generator=torch.Generator().manual_seed(case.seed + 1))
            loss, _ = logitless.policy_loss(x, weight, ids, mask, advantages, options=options)
        elif case.function == "cross_entropy":
            loss, _ = logitless.cross_entropy(x, weight, ids.masked_fill(mask == 0, -100), options=options)
        elif case.function == "vocab_stats":
            st = logitless.vocab_stats(x, weight, ids.masked_fill(mask == 0, -100), options=options)
            loss = sum(s.sum() for s in st if s is not None)
        else:
            return logitless.token_logprobs(x, weight, ids.masked_fill(mask == 0, -100), options=options)
        loss.backward()
        return loss

    return call


def measure(case: Case, chunks: int = 1) -> CallPath:
    """The call path of ``case`` with ``chunks`` chunks (one untraced warm-up call first)."""
    call = make_call(case, chunks)
    call()
    with Tracer() as tracer:
        call()
    return tracer.path


# ----------------------------------------------------------------------------- report


def report(case: Case, paths: dict[int, CallPath]) -> dict:
    """The measures of ``paths`` (by chunk count) as a JSON-ready dict."""
    one = paths[1]
    counts = {k: len(p.cross_file) for k, p in paths.items()}
    ks = sorted(paths)
    return {
        "case": dataclasses.asdict(case)
        | {
            "tokens": case.tokens,
            "dtype": "float32",
            "device": "cpu",
            "options": "PassOptions(mode='fused', impl='torch')",
            "python": sys.version.split()[0],
            "torch": torch.__version__,
        },
        "by_chunks": {str(k): paths[k].summary() for k in ks},
        "per_extra_chunk": [counts[b] - counts[a] for a, b in pairwise(ks)],
        "python_calls_per_extra_chunk": [paths[b].python_calls - paths[a].python_calls for a, b in pairwise(ks)],
        "files": one.files,
        "per_file": one.per_file(),
        "edges": [{"caller": a, "callee": b, "calls": n} for (a, b), n in one.edges().most_common()],
        "cross_file_sequence": [
            f"{c.caller_file}::{c.caller} -> {c.callee_file}::{c.callee}" + (" (callback)" if c.callback else "")
            for c in one.cross_file
        ],
    }


def print_report(data: dict, sequence: bool, top: int) -> None:
    c = data["case"]
    runs = "forward only (no gradient)" if c["function"] == "token_logprobs" else "forward + backward"
    print(
        f"{c['function']}: CPU, fp32, {c['options']}, {c['tokens']} tokens, V={c['vocab']}, "
        f"H={c['hidden_size']}; {runs} (python {c['python']}, torch {c['torch']})"
    )
    by = data["by_chunks"]
    ks = list(by)
    print(f"{'':28}" + "".join(f"{k + (' chunk' if k == '1' else ' chunks'):>10}" for k in ks))
    for key, label in (
        ("cross_file_calls", "cross-file calls"),
        ("files", "files"),
        ("python_calls", "python calls in package"),
        ("layer_switches", "layer switches"),
        ("callbacks", "callbacks (ops -> caller)"),
    ):
        print(f"{label:28}" + "".join(f"{by[k][key]:>10}" for k in ks))
    print(
        f"per extra chunk: {data['per_extra_chunk']} cross-file calls, "
        f"{data['python_calls_per_extra_chunk']} python calls"
    )
    print("entries: " + ", ".join(by["1"]["entries"]))
    print("\nper file (1 chunk):      calls  cross-in  cross-out")
    for f, d in sorted(data["per_file"].items(), key=lambda kv: -kv[1]["cross_in"] - kv[1]["cross_out"]):
        print(f"  {f:34}{d['calls']:>5}{d['cross_in']:>10}{d['cross_out']:>11}")
    print(f"\ncross-file edges (1 chunk, top {top}):")
    for e in data["edges"][:top]:
        print(f"  {e['calls']:>3}  {e['caller']} -> {e['callee']}")
    if sequence:
        print("\ncross-file calls in order (1 chunk):")
        for i, s in enumerate(data["cross_file_sequence"], 1):
            print(f"  {i:>3}  {s}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--function", choices=ENTRY_POINTS, default="policy_loss")
    ap.add_argument("--json", metavar="PATH", help="also write the measures here")
    ap.add_argument("--sequence", action="store_true", help="print every cross-file call of the 1-chunk call")
    ap.add_argument("--top", type=int, default=15, help="edges to print (default 15)")
    args = ap.parse_args(argv)
    case = Case(function=args.function)
    data = report(case, {k: measure(case, k) for k in (1, 2, 3)})
    print_report(data, args.sequence, args.top)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    return data


if __name__ == "__main__":
    main()
