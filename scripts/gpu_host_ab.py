"""Host time before the first Triton launch, and the call's time, of bench rows (GPU only).

    python3 scripts/gpu_host_ab.py TAG OBJECTIVE,SHAPE,ROW ...
    python3 scripts/gpu_host_ab.py new rollout,8k:llama3-8b,logitless grpo,4k:llama3-8b,logitless-fused

For each row, 40 calls, each after a synchronization: the median host time from the call's start to
its first Triton launch (``nan`` for rows without one, e.g. ``floor``) and the median event time of
the call, as the bench times it. The same code measures up to 2x apart in two processes on one host,
so compare two versions in interleaved processes: run this under ``PYTHONPATH`` of each version's
``src`` in turn (e.g. ``git archive REV src | tar -x -C /tmp/base``), several rounds.
``PROF=1`` adds a cProfile of 30 calls up to the first launch (stopped there).
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch
import triton.runtime.jit as jit

from logitless.bench.cases import make_inputs, parse_shape
from logitless.bench.competitors import ROWS


class _Stop(Exception):
    pass


def main() -> None:
    dev = torch.device("cuda")
    tag, specs = sys.argv[1], sys.argv[2:]
    firsts: list[float] = []
    stop = [False]
    run = jit.JITFunction.run

    def timed_run(self, *args, **kwargs):
        firsts.append(time.perf_counter())
        if stop[0]:
            raise _Stop
        return run(self, *args, **kwargs)

    jit.JITFunction.run = timed_run
    inputs = {}
    for spec in specs:
        objective, shape, name = spec.split(",")
        if shape not in inputs:
            inputs[shape] = make_inputs(parse_shape(shape), dev, torch.bfloat16)
        x = inputs[shape]
        step = next(r for r in ROWS if r.objective == objective and r.name == name).prepare(x, "auto").step

        def reset(x=x) -> None:
            x.hidden.grad = x.weight.grad = None

        for _ in range(5):
            reset()
            step()
        host, call = [], []
        for _ in range(40):
            reset()
            torch.cuda.synchronize()
            firsts.clear()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            step()
            end.record()
            end.synchronize()
            host.append(firsts[0] - t0 if firsts else float("nan"))
            call.append(start.elapsed_time(end))
        print(f"{tag:5s} {spec:38s} host to first launch {statistics.median(host) * 1e3:.3f} ms, "
              f"call {statistics.median(call):.3f} ms")
        if os.environ.get("PROF"):
            stop[0] = True
            prof = cProfile.Profile()
            for _ in range(30):
                reset()
                torch.cuda.synchronize()
                prof.enable()
                try:
                    step()
                except _Stop:
                    pass
                prof.disable()
            stop[0] = False
            torch.cuda.synchronize()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(28)
            print(text.getvalue())


if __name__ == "__main__":
    main()
