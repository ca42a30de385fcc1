"""Where the host's wall time goes in one call of a logitless bench row, up to the launch of its
first long kernel (GPU only). While the host prepares a call the GPU idles, so this time is
added to the call's.

    python3 scripts/gpu_host_phases.py [OBJECTIVE] [SHAPE] [ROW]
    python3 scripts/gpu_host_phases.py grpo 8k:llama3-8b logitless-fused

First the host time from the call's start to its first Triton launch, unhooked. Then every
logitless function that took over 40 us of wall time, in call order, indented by depth, with
its wall time (a synchronization inside shows up in the function's time, e.g.
``ValueChecks.run``). Each logitless function is wrapped in a timer (about a microsecond a
call), so the times are slight upper bounds.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time

import torch

from logitless.bench.batches import group_inputs, is_group_objective
from logitless.bench.cases import make_inputs, parse_shape
from logitless.bench.competitors import rows_of


def main() -> None:
    objective = sys.argv[1] if len(sys.argv) > 1 else "grpo"
    case = parse_shape(sys.argv[2] if len(sys.argv) > 2 else "8k:llama3-8b")
    name = sys.argv[3] if len(sys.argv) > 3 else "logitless-fused"
    dev = torch.device(os.environ.get("DEVICE", "cuda"))
    x = make_inputs(case, dev, torch.bfloat16)
    if is_group_objective(objective):  # grpo-c<percent>[-kl]: advantages from group rewards
        x = group_inputs(x, objective)
    row = next(r for r in rows_of(objective) if r.name == name)
    prepared = row.prepare(x, "auto" if dev.type == "cuda" else "torch")

    def reset() -> None:
        x.hidden.grad = x.weight.grad = None

    for _ in range(3):
        reset()
        prepared.step()
    _sync(dev)
    print(f"{objective} {case} {name}: host time to its first Triton launch, no hook: "
          f"{_to_first_launch(prepared.step, reset, dev) * 1e3:.3f} ms (median of 10)")
    for _rep in range(2):  # the first traced call warms the hook's own paths
        reset()
        _sync(dev)
        records, start = _traced(prepared.step)
        host = time.perf_counter() - start
        _sync(dev)
        total = time.perf_counter() - start
    print(f"{objective} {case} {name}: host {host * 1e3:.3f} ms, to the end of the GPU work {total * 1e3:.3f} ms")
    for depth, t0, dur, label in sorted(records, key=lambda r: r[1]):
        if dur > 40e-6:
            print(f"  {(t0 - start) * 1e3:8.3f} {dur * 1e3:8.3f} ms  {'  ' * depth}{label}")


def _to_first_launch(step, reset, dev: torch.device) -> float:
    """Seconds from the call's start to the host entering Triton's launcher the first time."""
    import triton.runtime.jit as jit

    run = jit.JITFunction.run
    firsts: list[float] = []

    def timed_run(self, *args, **kwargs):
        firsts.append(time.perf_counter())
        return run(self, *args, **kwargs)

    waits = []
    jit.JITFunction.run = timed_run
    try:
        for _ in range(10):
            reset()
            _sync(dev)
            firsts.clear()
            start = time.perf_counter()
            step()
            waits.append((firsts[0] if firsts else float("nan")) - start)
    finally:
        jit.JITFunction.run = run
    return statistics.median(waits)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _traced(step) -> tuple[list[tuple[int, float, float, str]], float]:
    """Run ``step`` with every function and method of the logitless package wrapped in a timer
    (about a microsecond a call, far less than a profile hook that fires for every Python call):
    (depth, start, wall time, name) of each call, and when ``step`` started (after the wrapping)."""
    import inspect

    records: list[tuple[int, float, float, str]] = []
    depth = [0]
    wrapped: dict[object, object] = {}

    def timer(fn, label):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                records.append((depth[0], t0, time.perf_counter() - t0, label))
        return call

    def ours(obj) -> bool:
        return inspect.isfunction(obj) and obj.__module__.startswith("logitless.")

    modules = [m for name, m in list(sys.modules.items()) if name.split(".")[0] == "logitless" and m is not None]
    undo: list[tuple[object, str, object]] = []
    for mod in modules:
        for name, obj in list(vars(mod).items()):
            if ours(obj):
                if obj not in wrapped:
                    wrapped[obj] = timer(obj, f"{obj.__module__.removeprefix('logitless.')}.{obj.__qualname__}")
                undo.append((mod, name, obj))
                setattr(mod, name, wrapped[obj])
            elif inspect.isclass(obj) and obj.__module__ == mod.__name__:
                for attr, raw in list(vars(obj).items()):
                    fn = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
                    if attr.startswith("__") or not ours(fn):
                        continue
                    w = timer(fn, f"{fn.__module__.removeprefix('logitless.')}.{fn.__qualname__}")
                    undo.append((obj, attr, raw))
                    setattr(obj, attr, type(raw)(w) if isinstance(raw, (staticmethod, classmethod)) else w)
    start = time.perf_counter()
    try:
        step()
    finally:
        for owner, name, obj in reversed(undo):
            setattr(owner, name, obj)
    return records, start


if __name__ == "__main__":
    main()
