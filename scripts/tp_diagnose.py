"""Where a vocabulary-parallel (TP=k) training step loses time against TP=1 / k; run by
``scripts/gpu_distributed.py --diagnose`` in every rank of its process group.

Per rank, fused GRPO (dapo, beta 0.04) at one shape, each variant run as a trainer runs it
(inputs made once; ``policy_loss`` + ``loss.backward()``):

* ``tp1``: the whole head on this GPU alone;
* ``local``: this rank's V/k rows alone, no group: the per-rank GEMM work without any
  communication, (a);
* ``tp``: the same rows with a ``VocabShard`` over a group of k ranks;
* ``tp-nodh``: ``tp`` with ``reduce_grad_hidden=False``: the step without its final ``d hidden``
  sum (a 16-bit ``d hidden``: fp32 reduce-scatter + bf16 all-gather, ``distributed.sum_partials``), (c).

Then, for one ``tp`` step each: every collective the engine makes (caller, kind, op, bytes), timed with
CUDA events on the compute stream, and the same collectives alone after a barrier (the
difference is waiting for the slowest peer), (b) and (c); a ``torch.profiler`` trace split into
GPU time in compute kernels, NCCL time not overlapped by compute, and idle time (the GPU waiting
for the host: launch gaps, host synchronizations), (d); the host synchronizations of the step
(``torch.cuda.set_sync_debug_mode``) with their call sites; and the ``d hidden`` all-reduce
alone, the ``d weight`` GEMM alone and both at once (whether the engine could hide the
all-reduce behind that GEMM).

On the CPU (gloo, ``--dry-run``) the same code runs without the CUDA-only parts.
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import json
import os
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

import logitless
from logitless import Head, LogitTransform, PassOptions, PolicyConfig, VocabShard
from logitless.distributed import all_reduce, sum_partials

TRANSFORM = LogitTransform(temperature=0.9)
CONFIG = PolicyConfig(loss_type="dapo", beta=0.04)
MARK = "tp_step"  # the profiler annotation around one step


@dataclass
class Batch:
    """One step's inputs, made once: ``hidden`` is a ``[b, t, H]`` bf16 leaf."""

    hidden: torch.Tensor
    ids: torch.Tensor
    mask: torch.Tensor
    adv: torch.Tensor
    old: torch.Tensor
    ref: torch.Tensor


def make_batch(n: int, h: int, v: int, dev: torch.device, b: int = 16, seed: int = 2) -> tuple[Batch, torch.Tensor]:
    """The batch (``n`` tokens in ``b`` sequences) and the whole ``[v, h]`` bf16 head, the same on every rank."""
    g = torch.Generator(device=dev).manual_seed(seed)  # on the device: the same numbers on every rank
    t = n // b
    weight = (torch.randn(v, h, generator=g, device=dev) / h**0.5 * 2).to(torch.bfloat16)
    hidden = (torch.randn(b, t, h, generator=g, device=dev) * 2).to(torch.bfloat16).requires_grad_()
    ids = torch.randint(0, v, (b, t), generator=g, device=dev)
    adv = torch.randn(b, generator=g, device=dev)
    old, ref = (torch.randn(2, b, t, generator=g, device=dev) * 0.1 - 3).unbind(0)
    return Batch(hidden, ids, torch.ones(b, t, device=dev), adv, old, ref), weight


def make_step(batch: Batch, rows: torch.Tensor, shard: VocabShard | None, ids: torch.Tensor,
              impl: str = "auto") -> Callable[[], None]:
    """One training step over the head rows ``rows`` (a leaf of their own) on the backend ``impl``."""
    weight = rows.detach().requires_grad_()

    def step() -> None:
        batch.hidden.grad = weight.grad = None
        loss, _ = logitless.policy_loss(batch.hidden, Head(weight, transform=TRANSFORM, shard=shard), ids, batch.mask,
                                        batch.adv, batch.old, batch.ref, config=CONFIG,
                                        options=PassOptions(mode="fused", impl=impl))
        loss.backward()

    step.weight = weight  # the leaf whose .grad a step writes
    return step


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn: Callable[[], object], dev: torch.device, reps: int, warm: int = 2) -> float:
    """Mean wall ms of ``fn`` over ``reps`` calls, all ranks starting together."""
    for _ in range(warm):
        fn()
    sync(dev)
    dist.barrier()
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(dev)
    return 1e3 * (time.perf_counter() - t0) / reps


def make_filler(batch: Batch, dev: torch.device, target_ms: float = 8.0) -> tuple[Callable[[], None], float]:
    """A GPU-only stand-in for the model's forward before the head (GEMMs of about ``target_ms``
    without a host synchronization), and its ms: a step launched right after it has its host
    preparation hidden behind it, as in a trainer."""
    a = batch.hidden.detach().reshape(-1, batch.hidden.shape[-1])
    b = torch.randn(a.shape[1], 4 * a.shape[1], device=dev).to(a.dtype)
    c = torch.empty(a.shape[0], b.shape[1], device=dev, dtype=a.dtype)
    one = timed(lambda: torch.mm(a, b, out=c), dev, 5)
    reps = max(1, round(target_ms / max(one, 1e-3))) if dev.type == "cuda" else 1

    def filler() -> None:
        for _ in range(reps):
            torch.mm(a, b, out=c)

    return filler, timed(filler, dev, 5)


def _op_name(op) -> str:
    for name in ("SUM", "MAX", "MIN"):
        if op == getattr(dist.ReduceOp, name):
            return name.lower()
    return str(op)


class AllReduceLog:
    """Records every ``torch.distributed`` all-reduce, reduce-scatter and all-gather (single
    tensor) made inside the ``with`` block: caller, collective, op, shape, dtype, bytes (the
    larger of input and output), and (after :meth:`finish`) ms between the compute stream
    reaching the call and the result being ready on it (transfer plus waiting for peers)."""

    # collective -> the names torch.distributed has had for it (logitless.distributed looks them up per call)
    KINDS: ClassVar[dict[str, tuple[str, ...]]] = {
        "all_reduce": ("all_reduce",), "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor"),
        "all_gather": ("all_gather_single", "all_gather_into_tensor")}

    def __init__(self, dev: torch.device):
        self.dev, self.calls, self._orig = dev, [], []

    def _mark(self):
        if self.dev.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _wrap(self, kind: str, orig):
        def recorded(*args, op=dist.ReduceOp.SUM, group=None, async_op=False):
            caller = sys._getframe(2).f_code  # 0: here, 1: the logitless.distributed function
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if kind != "all_gather":
                args = (*args, op)
            start = self._mark()
            work = orig(*args, group=group, async_op=async_op)
            big = max(tensors, key=lambda t: t.numel() * t.element_size())
            self.calls.append(dict(caller=f"{os.path.basename(caller.co_filename)}:{caller.co_name}", kind=kind,
                                   op=_op_name(op) if kind != "all_gather" else "-", shape=list(big.shape),
                                   dtype=str(big.dtype).removeprefix("torch."),
                                   bytes=big.numel() * big.element_size(), marks=(start, self._mark()),
                                   tensors=[(list(t.shape), t.dtype) for t in tensors], group=group))
            return work

        return recorded

    def __enter__(self) -> AllReduceLog:
        for kind, names in self.KINDS.items():
            for name in names:
                if hasattr(dist, name):
                    self._orig.append((name, getattr(dist, name)))
                    setattr(dist, name, self._wrap(kind, getattr(dist, name)))
        return self

    def __exit__(self, *exc) -> None:
        for name, orig in self._orig:
            setattr(dist, name, orig)
        self._orig = []

    def finish(self) -> list[dict]:
        sync(self.dev)
        for c in self.calls:
            s, e = c.pop("marks")
            c["ms"] = s.elapsed_time(e) if self.dev.type == "cuda" else 1e3 * (e - s)
        return self.calls


def isolated_all_reduce_ms(call: dict, dev: torch.device, reps: int = 10) -> float:
    """The collective of ``call`` alone (same kind, op, shapes, dtypes and group), all ranks aligned."""
    tensors = [torch.ones(shape, dtype=dtype, device=dev) for shape, dtype in call["tensors"]]
    if call["kind"] == "all_reduce":
        op = getattr(dist.ReduceOp, call["op"].upper())
        return timed(lambda: dist.all_reduce(tensors[0], op=op, group=call["group"]), dev, reps)
    fn = next(getattr(dist, name) for name in AllReduceLog.KINDS[call["kind"]] if hasattr(dist, name))
    return timed(lambda: fn(*tensors, group=call["group"]), dev, reps)


def collective_probe(n: int, h: int, rows: int, group, dev: torch.device, reps: int = 10) -> dict:
    """Collectives of a TP step alone and their alternatives (ms), for the proposals:

    * the fp32 ``[n, h]`` d hidden all-reduce; in bf16; as an fp32 reduce-scatter + bf16
      all-gather (the same fp32 sum, cast once, 3/4 of the bytes); the engine's d hidden sum
      whole, as it was (copy, fp32 all-reduce, cast) and as it is (``sum_partials``);
    * the bf16 ``d weight = dyᵀ h`` GEMM of a ``rows``-row shard alone, and at once with the fp32
      all-reduce (launched async before it): can the engine hide the all-reduce there?
    * the statistics' MAX ``[n]`` + SUM ``[3, n]`` all-reduces against one all-gather of every
      rank's ``[4, n]`` partials (merged locally as the gemm backend merges its tiles).
    """
    k = dist.get_world_size(group)
    dy = torch.randn(n, rows, device=dev).to(torch.bfloat16)
    hid = torch.randn(n, h, device=dev).to(torch.bfloat16)
    dh = torch.ones(n, h, device=dev)
    dh_bf16 = dh.to(torch.bfloat16)
    m, st, mine = torch.ones(n, device=dev), torch.ones(3, n, device=dev), torch.ones(4, n, device=dev)
    gathered = torch.empty(k * 4, n, device=dev)

    def both():
        work = dist.all_reduce(dh, group=group, async_op=True)
        torch.mm(dy.t(), hid)
        work.wait()

    out = {"all_reduce_fp32_ms": timed(lambda: dist.all_reduce(dh, group=group), dev, reps),
           "all_reduce_bf16_ms": timed(lambda: dist.all_reduce(dh_bf16, group=group), dev, reps),
           "d_weight_gemm_ms": timed(lambda: torch.mm(dy.t(), hid), dev, reps),
           "both_ms": timed(both, dev, reps),
           "stats_max_sum_ms": timed(lambda: (dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group),
                                              dist.all_reduce(st, group=group)), dev, reps),
           "stats_all_gather_ms": timed(lambda: dist.all_gather_into_tensor(gathered, mine, group=group), dev, reps)}
    if n % k == 0:
        part = torch.empty(n // k, h, device=dev)
        full = torch.empty(n, h, device=dev, dtype=torch.bfloat16)

        def rs_ag():
            dist.reduce_scatter_tensor(part, dh, group=group)
            dist.all_gather_into_tensor(full, part.to(torch.bfloat16), group=group)

        out["rs_fp32_ag_bf16_ms"] = timed(rs_ag, dev, reps)
    # the engine's d hidden sum as a whole: before (a copy, the fp32 all-reduce, the cast of all of it) and now
    # (logitless.distributed.sum_partials: fp32 reduce-scatter, the shard's cast, bf16 all-gather)
    out["dh_all_reduce_cast_ms"] = timed(lambda: all_reduce(dh, "sum", group).to(torch.bfloat16), dev, reps)
    out["dh_sum_partials_ms"] = timed(lambda: sum_partials(dh, torch.bfloat16, group), dev, reps)
    return out


class OverlapGradHidden:
    """Experiment, by patching (``ops`` unchanged): the ``d hidden`` all-reduce starts (async)
    right after the ``d hidden`` GEMM, so it runs during the ``d weight`` GEMM, and the engine's
    own sum after the pass (``sum_partials``) is skipped. Only a pass of one chunk of all ``n`` rows whose
    backward runs one vocabulary block takes it (``taken`` counts them); others run unchanged."""

    def __init__(self, group, n: int):
        self.group, self.n, self.taken, self._reduced, self._saved = group, n, 0, False, []

    def __enter__(self) -> OverlapGradHidden:
        from logitless.ops import fused
        from logitless.ops.gemm_backend import backend as gemm_backend
        from logitless.ops.triton_backend import backend as triton_backend

        block_grads, engine_sum = triton_backend.block_grads, fused.sum_partials

        def overlapped(dy, weight, hidden, block, acc, grad_hidden):
            if not (acc.hidden and grad_hidden is None and block.start == 0 and block.stop == weight.shape[0]
                    and hidden.shape[0] == self.n):
                return block_grads(dy, weight, hidden, block, acc, grad_hidden)
            gh = block_grads(dy, weight, hidden, block,
                             dataclasses.replace(acc, weight=None, bias=None, weight_lo=None), None)
            work = dist.all_reduce(gh, group=self.group, async_op=True)
            block_grads(dy, weight, hidden, block, dataclasses.replace(acc, hidden=False), None)
            work.wait()
            self._reduced, self.taken = True, self.taken + 1
            return gh

        def summed(t, dtype, group):
            if self._reduced and t.dim() == 2 and t.shape[0] == self.n:
                self._reduced = False  # reduced above
                return t.to(dtype)
            return engine_sum(t, dtype, group)

        self._saved = [(gemm_backend, "block_grads", gemm_backend.block_grads),
                       (triton_backend, "block_grads", block_grads), (fused, "sum_partials", engine_sum)]
        gemm_backend.block_grads = triton_backend.block_grads = overlapped
        fused.sum_partials = summed
        return self

    def __exit__(self, *exc) -> None:
        for module, name, value in self._saved:
            setattr(module, name, value)


def _union_us(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, -float("inf")
    for s, e in sorted(spans):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def trace_summary(events: list[dict], mark: str = MARK) -> dict:
    """One step's chrome-trace events split into host time, GPU busy time (compute kernels, NCCL
    kernels not overlapped by compute) and GPU idle time (ms); the top kernels by time."""
    win = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e.get("name") == mark]
    if not win:
        return {}
    start, host = float(win[0]["ts"]), float(win[0]["dur"])
    gpu = [(float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("name", "")) for e in events
           if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
           and float(e["ts"]) + float(e["dur"]) >= start]
    out = {"host_ms": host / 1e3}
    if not gpu:
        return out
    busy = _union_us([(s, e) for s, e, _ in gpu])
    compute = _union_us([(s, e) for s, e, name in gpu if "nccl" not in name.lower()])
    wall = max(start + host, max(e for _, e, _ in gpu)) - start
    top = collections.Counter()
    for s, e, name in gpu:
        top[name[:70]] += (e - s) / 1e3
    gpu.sort()
    # the pass's first large kernel (>= 5% of the compute time): the host work before it is not
    # hidden in a plain step; the longest idle gaps, with the kernels around them
    big = next(s for s, e, name in gpu if e - s >= 0.05 * compute or (e - s) == max(b - a for a, b, _ in gpu))
    gaps, end = [], start
    prev = "(step start)"
    for s, e, name in gpu:
        if s > end:
            gaps.append((round((s - end) / 1e3, 3), prev[:50], name[:50]))
        if e > end:
            end, prev = e, name
    out.update(wall_ms=wall / 1e3, busy_ms=busy / 1e3, compute_ms=compute / 1e3, nccl_exposed_ms=(busy - compute) / 1e3,
               idle_ms=(wall - busy) / 1e3, lead_ms=(gpu[0][0] - start) / 1e3, big_lead_ms=(big - start) / 1e3,
               kernels=len(gpu), top_kernels=[(name, round(ms, 3)) for name, ms in top.most_common(8)],
               idle_gaps=sorted(gaps, reverse=True)[:6])
    return out


def profile_step(step: Callable[[], None], dev: torch.device, save: str | None = None) -> dict:
    """:func:`trace_summary` of one ``step`` under ``torch.profiler`` (the trace gzipped to ``save``)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    sync(dev)
    with profile(activities=activities) as prof:
        with record_function(MARK):
            step()
        sync(dev)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    if save:
        with gzip.open(save, "wt") as f:
            json.dump(trace, f)
    return trace_summary(trace["traceEvents"] if isinstance(trace, dict) else trace)


def host_syncs(step: Callable[[], None], dev: torch.device) -> list[tuple[str, int]]:
    """The host synchronizations of one ``step`` (CUDA only): ``(logitless call site, count)``."""
    if dev.type != "cuda":
        return []
    sites: collections.Counter[str] = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):  # another warning, not a sync
            return
        frames = [f for f in traceback.extract_stack()
                  if "logitless" in f.filename and "/scripts/" not in f.filename and "/torch/" not in f.filename]
        where = " <- ".join(f"{f.filename.rsplit('logitless/', 1)[-1]}:{f.lineno} {f.line}" for f in frames[::-1][:2])
        sites[where or f"{filename}:{lineno}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown, warnings.showwarning = warnings.showwarning, record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = shown
        sync(dev)
    return sites.most_common()


def overlap_experiment(step: Callable[[], None], batch: Batch, group, n: int, dev: torch.device, reps: int,
                       behind: Callable[[Callable[[], None]], float]) -> dict:
    """``step`` under :class:`OverlapGradHidden`: its ms (plain and behind the filler), how many
    passes took the overlapped path, and its gradients' relative difference from ``step``'s own."""
    step()
    want = batch.hidden.grad.clone(), step.weight.grad.clone()
    try:
        with OverlapGradHidden(group, n) as patch:
            step()
            got = batch.hidden.grad.clone(), step.weight.grad.clone()
            out = {"ms": timed(step, dev, reps), "behind_ms": behind(step)}
    except (ImportError, AttributeError) as e:  # the ops modules it patches moved
        return {"error": f"{type(e).__name__}: {e}"}
    out["taken"] = patch.taken
    out["rel_diff"] = [((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()
                       for a, b in zip(got, want, strict=True)]
    return out


def _rows(v: int, k: int, j: int) -> tuple[int, int]:
    """Rows ``(start, count)`` of part ``j`` of ``v`` split over ``k`` (the first ``v % k`` one longer)."""
    sizes = [v // k + (1 if r < v % k else 0) for r in range(k)]
    return sum(sizes[:j]), sizes[j]


def diagnose(rank: int, world: int, shape: tuple[int, int, int], dev: torch.device, reps: int,
             out_dir: str | None, log: Callable[[str], None], impl: str = "auto") -> dict:
    """This rank's measurements for TP=1 and every k in {2, world} (see the module docstring),
    the pass on the backend ``impl``."""
    n, h, v = shape
    sizes = sorted({k for k in (2, world) if 1 < k <= world and world % k == 0})
    # every rank joins every group's creation, in the same order
    groups = {k: dist.group.WORLD if k == world else
              [dist.new_group(list(range(s, s + k))) for s in range(0, world, k)][rank // k] for k in sizes}
    batch, weight = make_batch(n, h, v, dev)
    out: dict = {"rank": rank, "shape": [n, h, v]}
    log("diagnose: tp1")
    filler, filler_ms = make_filler(batch, dev)
    out["filler_ms"] = filler_ms

    def behind(step):  # ms of ``step`` launched right after the filler (its host work hidden)
        return timed(lambda: (filler(), step()), dev, reps) - filler_ms

    tp1 = make_step(batch, weight, None, batch.ids, impl)
    out["tp1"] = {"ms": timed(tp1, dev, reps), "behind_ms": behind(tp1), "profile": profile_step(tp1, dev),
                  "syncs": host_syncs(tp1, dev)}
    del tp1
    for k in sizes:
        group, j = groups[k], rank % k
        start, rows = _rows(v, k, j)
        part = weight[start:start + rows]
        shard = VocabShard(group=group, vocab_start=start, vocab_size=v)
        no_dh = VocabShard(group=group, vocab_start=start, vocab_size=v, reduce_grad_hidden=False)
        steps = {"local": make_step(batch, part, None, batch.ids % rows, impl),
                 "tp": make_step(batch, part, shard, batch.ids, impl),
                 "tp-nodh": make_step(batch, part, no_dh, batch.ids, impl)}
        res: dict = {"rows": rows}
        for name, step in steps.items():
            log(f"diagnose: tp{k} {name}")
            save = None
            if out_dir and rank == 0 and name == "tp" and k == world:
                save = os.path.join(out_dir, f"trace-tp{k}-rank0.json.gz")
            res[name] = {"ms": timed(step, dev, reps), "behind_ms": behind(step),
                         "profile": profile_step(step, dev, save)}
        sync(dev)
        dist.barrier()
        with AllReduceLog(dev) as recorded:
            steps["tp"]()
        calls = recorded.finish()
        for c in calls:
            c["isolated_ms"] = isolated_all_reduce_ms(c, dev)
            del c["group"]
        res["all_reduces"] = calls
        res["tp"]["syncs"] = host_syncs(steps["tp"], dev)
        log(f"diagnose: tp{k} with the d hidden all-reduce overlapped (experiment)")
        res["tp-overlap"] = overlap_experiment(steps["tp"], batch, group, n, dev, reps, behind)
        if dev.type == "cuda":
            log(f"diagnose: tp{k} collective probe")
            res["overlap"] = collective_probe(n, h, rows, group, dev)
        out[f"tp{k}"] = res
        del steps
    return out


# ----------------------------------------------------------------------------- the report (parent process)


def _mean(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _f(x: float | None, width: int = 7) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:{width}.2f}"


def _cell(x: float | int | None, width: int) -> str:
    return f"{x:>{width}}" if isinstance(x, int) else _f(x, width)


# (header, row key, width) of the per-rank table. *: launched right after a GPU-only filler
# (the model's forward in a trainer) that hides the step's host work before its first kernel;
# busy: GPU time in compute kernels; idle: GPU waiting for the host; lead, 1stbig: from the
# step's start to its first kernel, and to its first large kernel (>= 5% of busy: the pass's
# first GEMM); nccl-exp: NCCL time not overlapped by compute; AR: collectives (event ms in the
# step, and alone: iso); dh: d hidden (its all-reduce, or reduce-scatter + all-gather).
_COLUMNS = [("rank", "rank", 4), ("tp1", "tp1", 7), ("tp1/k", "ideal", 7), ("local", "local", 7), ("tp", "tp", 7),
            ("tp-nodh", "tp_nodh", 7), ("speedup", "speedup", 7), ("tp1*", "tp1_b", 7), ("tp*", "tp_b", 7),
            ("speedup*", "speedup_b", 8), ("busy1/k", "busy_ideal", 7), ("busyloc", "busy_local", 7),
            ("busytp", "busy_tp", 7), ("idle1/k", "idle_ideal", 7), ("idletp", "idle_tp", 7), ("lead", "lead_tp", 6),
            ("1stbig", "big_lead_tp", 6), ("nccl-exp", "nccl_exposed", 8), ("statAR#", "stats_n", 7),
            ("statAR", "stats_ms", 7), ("iso", "stats_iso", 6), ("dhAR", "dh_ms", 6), ("iso", "dh_iso", 6),
            ("syncs", "syncs", 5)]


def report(ranks: list[dict]) -> tuple[str, dict]:
    """The table printed for the lead and the summary stored beside the raw data."""
    lines, summary = [], {}
    n, h, v = ranks[0]["shape"]
    for key in [k for k in ranks[0] if k.startswith("tp") and k != "tp1"]:
        k = int(key[2:])
        lines.append(f"\n== TP{k} vs TP1: fused GRPO, N={n} H={h} V={v} (V/{k} = {ranks[0][key]['rows']} rows); "
                     "ms per step, per rank")
        lines.append(" ".join(f"{head:>{w}}" for head, _, w in _COLUMNS))
        rows = []
        for r in ranks:
            d, t1 = r[key], r["tp1"]
            p1, pl, pt = t1["profile"], d["local"]["profile"], d["tp"]["profile"]
            stats = [c for c in d["all_reduces"] if c["bytes"] < n * h * 2]
            dh = [c for c in d["all_reduces"] if c["bytes"] >= n * h * 2]
            row = dict(rank=r["rank"], tp1=t1["ms"], ideal=t1["ms"] / k, local=d["local"]["ms"], tp=d["tp"]["ms"],
                       tp_nodh=d["tp-nodh"]["ms"], speedup=t1["ms"] / d["tp"]["ms"], tp1_b=t1["behind_ms"],
                       tp_b=d["tp"]["behind_ms"], speedup_b=t1["behind_ms"] / max(d["tp"]["behind_ms"], 1e-6),
                       busy_ideal=p1["compute_ms"] / k if "compute_ms" in p1 else None,
                       busy_local=pl.get("compute_ms"), busy_tp=pt.get("compute_ms"),
                       idle_ideal=p1["idle_ms"] / k if "idle_ms" in p1 else None, idle_tp=pt.get("idle_ms"),
                       lead_tp=pt.get("lead_ms"), big_lead_tp=pt.get("big_lead_ms"),
                       nccl_exposed=pt.get("nccl_exposed_ms"),
                       stats_n=len(stats), stats_ms=sum(c["ms"] for c in stats),
                       stats_iso=sum(c["isolated_ms"] for c in stats),
                       dh_ms=sum(c["ms"] for c in dh), dh_iso=sum(c["isolated_ms"] for c in dh),
                       syncs=sum(c for _, c in d["tp"].get("syncs", [])))
            rows.append(row)
            lines.append(" ".join(_cell(row[name], w) for _, name, w in _COLUMNS))
        avg = {name: _mean([row[name] for row in rows]) for name in rows[0] if name != "rank"}
        gap = avg["tp"] - avg["ideal"]
        parts = {
            "(a) per-rank GEMM shape (busy local - busy tp1/k)": None if avg["busy_local"] is None
            else avg["busy_local"] - avg["busy_ideal"],
            "(a+d) the local V/k step alone, no communication (local - tp1/k, wall)": avg["local"] - avg["ideal"],
            "(b) statistics all-reduces (MAX+SUM, event ms in the step)": avg["stats_ms"],
            "(c) d hidden sum (all-reduce, or reduce-scatter + all-gather), in situ (tp - tp-nodh, wall)":
                avg["tp"] - avg["tp_nodh"],
            "(b+c) NCCL kernel time not overlapped by compute (profile)": avg["nccl_exposed"],
            "(d) GPU idle beyond tp1's share (idle tp - idle tp1/k, profile)": None if avg["idle_tp"] is None
            else avg["idle_tp"] - avg["idle_ideal"],
            "(d) waiting for the slowest rank at the collectives (in-step event ms - alone)":
                avg["stats_ms"] - avg["stats_iso"] + avg["dh_ms"] - avg["dh_iso"],
        }
        lines.append(f"-- mean over ranks: TP{k} {avg['tp']:.2f} ms = {avg['speedup']:.2f}x TP1 "
                     f"({100 * avg['speedup'] / k:.0f}% efficiency); gap to TP1/{k}: {gap:.2f} ms; the parts "
                     "overlap ((a+d) holds (a) and most of (d)):")
        for name, ms in parts.items():
            share = "" if ms is None or gap <= 0.02 * avg["tp"] else f" ({100 * ms / gap:.0f}% of the gap)"
            lines.append(f"   {name}: {_f(ms)} ms{share}")
        lines.append(f"   with the host work hidden behind a {ranks[0]['filler_ms']:.1f} ms GPU filler (a trainer's "
                     f"forward): TP1 {avg['tp1_b']:.2f} ms, TP{k} {avg['tp_b']:.2f} ms = {avg['speedup_b']:.2f}x "
                     f"({100 * avg['speedup_b'] / k:.0f}%)")
        fixed = None
        if avg["nccl_exposed"] is not None:
            # T(k) = F + C/k + comm: the fixed per-step cost that TP1's time and TP k's imply
            fixed = (k * (avg["tp"] - avg["nccl_exposed"]) - avg["tp1"]) / (k - 1)
            lines.append(f"   a step cost that does not shrink with k (F in T(k) = F + C/k + comm): {fixed:.2f} ms; "
                         f"first large kernel {avg['big_lead_tp']:.2f} ms after the step's start; "
                         f"{avg['syncs']:.0f} host syncs")
        exp = [r[key].get("tp-overlap", {}) for r in ranks]
        if all("ms" in e for e in exp):
            ms, ms_b = _mean([e["ms"] for e in exp]), _mean([e["behind_ms"] for e in exp])
            worst = max(max(e["rel_diff"]) for e in exp)
            verdict = "same gradients" if worst <= 1e-6 else "INVALID: gradients differ"
            lines.append(f"   experiment, d hidden all-reduce started before the d weight GEMM (patched; "
                         f"{min(e['taken'] for e in exp)} pass(es) took it): TP{k} {ms:.2f} ms = "
                         f"{avg['tp1'] / ms:.2f}x, behind the filler {ms_b:.2f} ms = {avg['tp1_b'] / ms_b:.2f}x "
                         f"({verdict}, max rel diff {worst:.1e})")
        elif exp and "error" in exp[0]:
            lines.append(f"   experiment not run: {exp[0]['error']}")
        probe = ranks[0][key].get("overlap")
        if probe and "dh_sum_partials_ms" in probe:
            lines.append("   rank 0, the engine's d hidden sum alone: as it was (copy, fp32 all-reduce, cast) "
                         "{dh_all_reduce_cast_ms:.2f} ms, as it is (fp32 reduce-scatter, shard cast, bf16 all-gather: "
                         "sum_partials) {dh_sum_partials_ms:.2f} ms".format(**probe))
        if probe:
            lines.append("   rank 0 collectives alone: d hidden all-reduce fp32 {all_reduce_fp32_ms:.2f} ms, bf16 "
                         "{all_reduce_bf16_ms:.2f} ms, fp32 reduce-scatter + bf16 all-gather {rs:.2f} ms; "
                         "d weight GEMM {d_weight_gemm_ms:.2f} ms, with the fp32 all-reduce at once {both_ms:.2f} ms; "
                         "statistics MAX+SUM {stats_max_sum_ms:.3f} ms, one all-gather {stats_all_gather_ms:.3f} ms"
                         .format(rs=probe.get("rs_fp32_ag_bf16_ms", float("nan")), **probe))
        summary[key] = {"mean": avg, "gap_ms": gap, "gap_parts_ms": parts, "fixed_cost_ms": fixed,
                        "target_3.6x_ms": avg["tp1"] / 3.6 if k == 4 else None}
    syncs = ranks[0]["tp1"].get("syncs") or []
    if syncs:
        lines.append("\nhost synchronizations of one TP1 step (rank 0): " + "; ".join(f"{n}x {s}" for s, n in syncs))
    for key in [k for k in ranks[0] if k.startswith("tp") and k != "tp1"]:
        for name in ("local", "tp"):
            top = ranks[0][key][name]["profile"].get("top_kernels")
            if top:
                lines.append(f"top kernels {key} {name} (rank 0, ms): " + "; ".join(f"{t} {ms}" for t, ms in top))
        gaps = ranks[0][key]["tp"]["profile"].get("idle_gaps")
        if gaps:
            lines.append(f"longest GPU idle gaps {key} (rank 0; ms, after, before): "
                         + "; ".join(f"{ms} {a} -> {b}" for ms, a, b in gaps))
    top = ranks[0]["tp1"]["profile"].get("top_kernels")
    if top:
        lines.append("top kernels tp1 (rank 0, ms): " + "; ".join(f"{t} {ms}" for t, ms in top))
    return "\n".join(lines), summary
