"""Where one call of a bench row spends its wall time (GPU only): the bench's own inputs and
rows, timed as the bench times them, then one call under torch.profiler split into GPU busy
time, idle gaps (with the CPU op running in each) and the host's time before the first kernel.

    python3 scripts/gpu_trace.py OUT_DIR [OBJECTIVE] [SHAPE] [ROW ...]
    python3 scripts/gpu_trace.py /tmp/t rollout 8k:llama3-8b floor kernel logitless trl-chunked
    HOST_PROFILE=1 python3 scripts/gpu_trace.py ...   # also cProfile the logitless rows' host side
    TIMELINE=1 python3 scripts/gpu_trace.py ...       # and list their GPU ops up to the first long kernel
"""

from __future__ import annotations

import cProfile
import io
import itertools
import json
import os
import pstats
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from logitless.bench.batches import group_inputs, is_group_objective
from logitless.bench.cases import make_inputs, parse_shape
from logitless.bench.competitors import Prepared, rows_of
from logitless.bench.timing import time_step
from logitless.ops.contract import StatRequest
from logitless.ops.gemm_backend.kernels import gemm_config, launch_forward
from logitless.ops.transform import LogitTransform
from logitless.ops.triton_shared.tile_gemm import TileOperands


def _profile(step, out: str, tag: str, timeline: bool = False) -> None:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=timeline) as prof:
        t0 = time.perf_counter_ns() / 1e3
        step()
        host_us = time.perf_counter_ns() / 1e3 - t0
        torch.cuda.synchronize()
    path = f"{out}/trace-{tag}.json"
    prof.export_chrome_trace(path)
    ev = json.load(open(path))["traceEvents"]
    kern = sorted([e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")], key=lambda e: e["ts"])
    cpu = [e for e in ev if e.get("cat") in ("cpu_op", "python_function") and "dur" in e]
    launches = sorted(e["ts"] for e in ev if e.get("cat") == "cuda_runtime" and "aunch" in e.get("name", ""))
    if not kern:
        print(f"  {tag}: no kernels")
        return
    start = min(e["ts"] for e in cpu) if cpu else kern[0]["ts"]
    span = kern[-1]["ts"] + kern[-1]["dur"] - start
    busy = sum(e["dur"] for e in kern)
    first_launch = (launches[0] - start) if launches else float("nan")
    print(f"  {tag}: {len(kern)} GPU ops; call start -> last kernel end {span / 1e3:.3f} ms, GPU busy "
          f"{busy / 1e3:.3f} ms, host call {host_us / 1e3:.3f} ms, first launch at {first_launch / 1e3:.3f} ms, "
          f"first kernel starts at {(kern[0]['ts'] - start) / 1e3:.3f} ms")
    gaps = []
    for a, b in itertools.pairwise(kern):
        gap = b["ts"] - (a["ts"] + a["dur"])
        if gap > 30:
            mid = a["ts"] + a["dur"] + gap / 2
            running = [c["name"][:50] for c in cpu if c["ts"] <= mid <= c["ts"] + c["dur"]]
            gaps.append((gap, a["name"][:36], b["name"][:36], running[-2:]))
    print(f"    idle gaps > 30 us: {len(gaps)}, {sum(g[0] for g in gaps) / 1e3:.3f} ms")
    for g in sorted(gaps, reverse=True)[:8]:
        print(f"    {g[0] / 1e3:6.3f} ms after {g[1]!r} before {g[2]!r} cpu: {g[3]}")
    by_name: dict[str, list[float]] = {}
    for e in kern:
        by_name.setdefault(e["name"][:70], []).append(e["dur"])
    for name, ds in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:10]:
        print(f"    {sum(ds) / 1e3:7.3f} ms  x{len(ds):<3d} {name}")
    if timeline:
        _timeline(kern, cpu, start)
        _sources(kern, cpu, [e for e in ev if e.get("cat") == "cuda_runtime"])


def _sources(kern, cpu, runtime) -> None:
    """The logitless Python frames that launched each GPU op over 50 us (by the launch's
    correlation id), summed per (op, frames)."""
    launch_at = {e["args"].get("correlation"): e["ts"] for e in runtime if "args" in e}
    frames = [c for c in cpu if c.get("cat") == "python_function" and "logitless" in c["name"]]
    total: dict[tuple[str, str], list[float]] = {}
    for e in kern:
        at = launch_at.get(e.get("args", {}).get("correlation"))
        if e["dur"] < 50 or at is None:
            continue
        inside = sorted((c for c in frames if c["ts"] <= at <= c["ts"] + c["dur"]), key=lambda c: c["ts"])
        where = " > ".join(c["name"].split("logitless/")[-1][:44] for c in inside[-3:])
        total.setdefault((e["name"][:40], where), []).append(e["dur"])
    print("    GPU ops over 50 us by the code that launched them (ms, count, op, frames):")
    for (name, where), ds in sorted(total.items(), key=lambda kv: -sum(kv[1])):
        print(f"     {sum(ds) / 1e3:7.3f} x{len(ds):<3d} {name:40s} {where}")


def _timeline(kern, cpu, start) -> None:
    """Every GPU op up to the first long kernel, with the idle gap before it and the innermost
    logitless Python frames the host was in during that gap."""
    print("    timeline up to the first kernel over 1 ms (offset, gap before, duration, op; host frames in the gap):")
    prev_end = start
    for e in kern:
        gap = e["ts"] - prev_end
        mid = prev_end + gap / 2
        frames = [c for c in cpu if c.get("cat") == "python_function" and "logitless" in c["name"]
                  and c["ts"] <= mid <= c["ts"] + c["dur"]]
        where = " > ".join(c["name"].split("logitless/")[-1][:48] for c in sorted(frames, key=lambda c: c["ts"])[-3:])
        at, dur = (e["ts"] - start) / 1e3, e["dur"] / 1e3
        print(f"     {at:7.3f} {gap / 1e3:6.3f} {dur:7.3f}  {e['name'][:40]:40s} {where}")
        prev_end = e["ts"] + e["dur"]
        if e["dur"] > 1000:
            break


def _host_profile(step, reset) -> None:
    """cProfile of 5 calls: where the host's time goes (own time per function, per call)."""
    prof = cProfile.Profile()
    for _ in range(5):
        reset()
        torch.cuda.synchronize()
        prof.enable()
        step()
        prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(22)
    lines = [ln for ln in text.getvalue().splitlines() if ln.strip()]
    print("    host profile, 5 calls (tottime, cumtime in s):")
    for ln in lines[3:]:
        print("     ", ln.replace(os.getcwd() + "/", "")[:150])


def main() -> None:
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    objective = sys.argv[2] if len(sys.argv) > 2 else "rollout"
    case = parse_shape(sys.argv[3] if len(sys.argv) > 3 else "8k:llama3-8b")
    names = sys.argv[4:] or ["floor", "logitless", "logitless-fused", "trl-chunked"]
    dev = torch.device("cuda")
    x = make_inputs(case, dev, torch.bfloat16)
    print(f"{objective} {case}")

    def reset() -> None:
        x.hidden.grad = x.weight.grad = None

    if is_group_objective(objective):  # grpo-c<percent>[-kl]: advantages from group rewards
        x = group_inputs(x, objective)
    rows = [(r.name, r.prepare(x, "auto")) for r in rows_of(objective) if r.name in names]
    if "kernel" in names:  # the statistics GEMM alone, as a rollout launches it
        h2, y = x.hidden.detach().reshape(-1, case.hidden_size), x.targets.reshape(-1)
        ops = TileOperands(h2, x.weight.detach(), None, y, LogitTransform())
        rows.append(("kernel", Prepared(lambda: launch_forward(ops, StatRequest(), True, None, gemm_config()))))
    for name, prepared in rows:
        for _ in range(3):
            reset()
            prepared.step()
        torch.cuda.synchronize()
        times = time_step(prepared.step, reset, dev, min_reps=10, max_reps=10)
        host = []
        for _ in range(5):
            reset()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            prepared.step()
            host.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):  # back to back: the host enqueues the next call while the GPU runs
            reset()
            prepared.step()
        end.record()
        end.synchronize()
        print(f"{name}: {times.median_ms:.3f} ms (events, median of 10); back to back "
              f"{start.elapsed_time(end) / 10:.3f} ms a call; host time of a call {statistics.median(host):.3f} ms")
        reset()
        _profile(prepared.step, out, name, timeline=bool(os.environ.get("TIMELINE")) and name.startswith("logitless"))
        reset()
        if os.environ.get("HOST_PROFILE") and name.startswith("logitless"):
            _host_profile(prepared.step, reset)


if __name__ == "__main__":
    main()
