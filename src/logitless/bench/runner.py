"""Runs the rows over the cases: warm-up + agreement check, peak memory, timing, ratios.

Per case, objective by objective: the floor first, then the logitless reference row (its
loss, outputs and gradients are what every other row is checked against), then the others.
A row that runs out of memory (or is predicted to: materializing rows whose ``[N, V]``
tensors cannot fit) is recorded as ``"oom"``; one that cannot run here as ``"skipped"``; any
other exception as ``"error"`` with its message, and the run goes on.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .batches import group_inputs, is_group_objective, zero_row_fraction
from .cases import Case, Inputs, make_inputs
from .competitors import OBJECTIVES, Outputs, Row, Unavailable, rows_of
from .timing import free_memory, is_oom, peak_bytes, rel_diff, synchronize, time_in_step, time_step

# "Same numbers": bf16 inputs, fp32 statistics. A loss within 1% and gradients within 5% (norm-wise)
# of logitless count as agreeing; the measured differences are in the JSON either way.
LOSS_TOL = 1e-2
GRAD_TOL = 5e-2


@dataclass
class Options:
    """What to run and how long to measure.

    Attributes:
        device: where the inputs live.
        dtype: input dtype of ``hidden``/``weight``.
        impls: logitless backends to run (``auto``, ``torch``, ``triton``); several → one
            set of logitless rows each, named ``logitless-fused[torch]`` ...
        objectives: subset of :data:`~logitless.bench.competitors.OBJECTIVES`.
        rows: row names to run (the floor always runs), or ``None`` for all.
        target_entropy: mean entropy (nats) the inputs are calibrated to.
        seed: input seed.
        min_time_s: timed repetitions last at least this long ...
        min_reps, max_reps: ... and take at least / at most this many calls.
        deadline: ``time.monotonic()`` value after which no further row starts, or ``None``.
    """

    device: torch.device
    dtype: torch.dtype = torch.bfloat16
    impls: list[str] = field(default_factory=lambda: ["auto"])
    objectives: list[str] = field(default_factory=lambda: list(OBJECTIVES))
    rows: list[str] | None = None
    target_entropy: float = 2.0
    seed: int = 0
    min_time_s: float = 1.0
    min_reps: int = 3
    max_reps: int = 20
    deadline: float | None = None


def expand_rows(objective: str, opts: Options) -> Iterator[tuple[Row, str, str]]:
    """``(row, impl, display name)`` of one objective, floor first, then the reference."""
    rows = list(rows_of(objective))
    rows.sort(key=lambda r: {"floor": 0, "reference": 1}.get(r.role, 2))
    for row in rows:
        if opts.rows is not None and row.role != "floor" and row.name not in opts.rows:
            continue
        if row.name.startswith("logitless"):
            for impl in opts.impls:
                name = row.name if len(opts.impls) == 1 else f"{row.name}[{impl}]"
                yield row, impl, name
        else:
            yield row, opts.impls[0], row.name


@dataclass
class _Reference:
    outputs: Outputs
    grad_hidden: torch.Tensor | None
    grad_weight: torch.Tensor | None


def _reset(x: Inputs) -> Callable[[], None]:
    def reset() -> None:
        x.hidden.grad = None
        x.weight.grad = None

    return reset


def _output_bytes(objective: str, x: Inputs, out: Outputs) -> int:
    """Bytes of what the work must produce: the two gradients, or a rollout's per-token results."""
    if objective == "rollout":
        n = x.targets.numel()
        return 2 * n * 4
    return (x.hidden.numel() + x.weight.numel()) * x.hidden.element_size()


def _check(rec: dict[str, Any], objective: str, x: Inputs, out: Outputs, ref: _Reference) -> None:
    diffs: dict[str, float] = {}
    for key, value in out.items():
        if key in ref.outputs:
            diffs[f"{key}_rel_diff"] = rel_diff(value, ref.outputs[key])
    if objective != "rollout":
        if x.hidden.grad is not None and ref.grad_hidden is not None:
            diffs["grad_hidden_rel_diff"] = rel_diff(x.hidden.grad, ref.grad_hidden)
        if x.weight.grad is not None and ref.grad_weight is not None:
            diffs["grad_weight_rel_diff"] = rel_diff(x.weight.grad, ref.grad_weight)
    rec.update(diffs)
    value_keys = [k for k in diffs if not k.startswith("grad_") and not k.startswith("entropy")]
    grad_keys = [k for k in diffs if k.startswith("grad_")]
    rec["agrees"] = (all(diffs[k] <= LOSS_TOL for k in value_keys)
                     and all(diffs[k] <= GRAD_TOL for k in grad_keys)) if diffs else None


def _predicted_oom(row: Row, case: Case, device: torch.device) -> str | None:
    if row.logit_bytes <= 0 or device.type != "cuda":
        return None
    need = row.logit_bytes * case.n_tokens * case.vocab_size
    free, _total = torch.cuda.mem_get_info(device)
    if need > free:
        return f"predicted: needs ~{need / 2**30:.0f} GiB for [N, V] tensors, {free / 2**30:.0f} GiB free"
    return None


def run_row(row: Row, impl: str, name: str, case: Case, x: Inputs, opts: Options,
            ref: _Reference | None, log: Callable[[str], None]) -> tuple[dict[str, Any], _Reference | None]:
    """Measure one row on one case. Returns its record and, for the reference row, its outputs."""
    rec: dict[str, Any] = {"objective": row.objective, "row": name, "role": row.role, "status": "ok",
                           "reason": None, "impl": None, "what": row.summary}
    reset = _reset(x)
    new_ref = None
    if opts.deadline is not None and time.monotonic() > opts.deadline:
        rec.update(status="skipped", reason="time budget spent")
        return rec, None
    predicted = _predicted_oom(row, case, opts.device)
    if predicted:
        rec.update(status="oom", reason=predicted)
        return rec, None
    try:
        prepared = row.prepare(x, impl)
    except Unavailable as e:
        rec.update(status="skipped", reason=str(e))
        return rec, None
    rec["impl"] = prepared.impl
    error = None
    try:
        reset()
        t0 = time.perf_counter()
        out = prepared.step()  # warm-up (compiles, autotunes) and the call that is checked
        synchronize(opts.device)
        rec["first_call_s"] = time.perf_counter() - t0
        if row.role == "reference":
            new_ref = _Reference({k: v.detach().clone() for k, v in out.items()},
                                 None if x.hidden.grad is None else x.hidden.grad.clone(),
                                 None if x.weight.grad is None else x.weight.grad.clone())
        elif ref is not None and row.role != "floor":
            _check(rec, row.objective, x, out, ref)
        for key in ("loss", "entropy"):
            if key in out and out[key].dim() == 0:
                rec[key] = float(out[key])
        out_bytes = _output_bytes(row.objective, x, out)
        del out
        peak = peak_bytes(prepared.step, reset, opts.device)
        if peak is not None:
            rec["peak_bytes"] = peak
            rec["extra_bytes"] = peak - out_bytes
        timing = time_step(prepared.step, reset, opts.device, min_reps=opts.min_reps, max_reps=opts.max_reps,
                           min_time_s=opts.min_time_s)
        rec["times_ms"] = [round(t, 4) for t in timing.times_ms]
        rec["time_ms"] = timing.median_ms
        rec["tflops"] = case.flops(row.objective) / (timing.median_ms * 1e-3) / 1e12
        in_step = time_in_step(prepared.step, reset, opts.device)
        if in_step is not None:
            rec["in_step_ms"] = in_step.median_ms
    except Exception as e:
        error = e
        if is_oom(e):
            rec.update(status="oom", reason=str(e).split("\n")[0][:300])
        else:
            rec.update(status="error", reason=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500])
            log(traceback.format_exc(limit=6))
    finally:
        del prepared
        reset()
        if error is not None:
            error.__traceback__ = None
        error = None
        free_memory(opts.device)
    return rec, new_ref


def run_case(case: Case, opts: Options, log: Callable[[str], None]) -> dict[str, Any]:
    """All objectives and rows of one case → the case's record (shape, inputs, row results)."""
    t0 = time.perf_counter()
    if opts.device.type == "cuda":
        # Fresh compile caches per case: compiled rows (torch.compile, Liger's compiled loss) compile each
        # shape statically instead of recompiling with dynamic shapes (which broke Liger on torch 2.11).
        torch._dynamo.reset()
    x = make_inputs(case, opts.device, opts.dtype, target_entropy=opts.target_entropy, seed=opts.seed)
    synchronize(opts.device)
    record: dict[str, Any] = {
        "model": case.model, "n_tokens": case.n_tokens, "hidden_size": case.hidden_size,
        "vocab_size": case.vocab_size, "batch": case.batch, "seq_len": case.seq_len,
        "dtype": str(opts.dtype).removeprefix("torch."), "target_entropy": opts.target_entropy,
        "true_mean_entropy": x.true_entropy, "setup_s": time.perf_counter() - t0, "results": [],
    }
    log(f"== {case.label} (H={case.hidden_size}, V={case.vocab_size}), inputs' mean entropy "
        f"{x.true_entropy:.2f} nats, setup {record['setup_s']:.1f}s")
    floors: dict[Any, dict[str, Any]] = {}
    for objective in opts.objectives:
        ref: _Reference | None = None
        floor_ms = floor_in_step = None
        xo = x
        if is_group_objective(objective):  # the same tokens laid out as a GRPO batch of groups
            xo = group_inputs(x, objective, opts.seed)
            record.setdefault("zero_row_fraction", {})[objective] = zero_row_fraction(xo)
        for row, impl, name in expand_rows(objective, opts):
            if row.role == "floor" and row.prepare in floors:  # the objectives of 6NHV share the 3-GEMM floor
                rec = {**floors[row.prepare], "objective": objective}
            else:
                rec, new_ref = run_row(row, impl, name, case, xo, opts, ref, log)
                ref = new_ref or ref
                if row.role == "floor":
                    floors[row.prepare] = rec
            if row.role == "floor" and rec["status"] == "ok":
                floor_ms, floor_in_step = rec["time_ms"], rec.get("in_step_ms")
            if rec["status"] == "ok" and floor_ms:
                rec["ratio_to_floor"] = rec["time_ms"] / floor_ms
                if floor_in_step and "in_step_ms" in rec:
                    rec["in_step_ratio"] = rec["in_step_ms"] / floor_in_step
            if objective == "grpo" and row.role == "reference" and "entropy" in rec:
                record["mean_entropy"] = rec["entropy"]
            record["results"].append(rec)
            log(_line(rec))
        del ref, xo
        free_memory(opts.device)
    del x
    free_memory(opts.device)
    record["case_s"] = time.perf_counter() - t0
    return record


def _line(rec: dict[str, Any]) -> str:
    head = f"  {rec['objective']:8s} {rec['row']:26s}"
    if rec["status"] != "ok":
        return f"{head} {rec['status']}: {rec['reason']}"
    mem = f" extra {rec['extra_bytes'] / 2**30:6.2f} GiB" if "extra_bytes" in rec else ""
    ratio = f" {rec['ratio_to_floor']:5.2f}x" if "ratio_to_floor" in rec else ""
    if "in_step_ratio" in rec:
        ratio += f" (in a step {rec['in_step_ratio']:.2f}x)"
    diff = ""
    if "loss_rel_diff" in rec or "logp_rel_diff" in rec:
        keys = [k for k in ("loss_rel_diff", "logp_rel_diff", "grad_hidden_rel_diff", "grad_weight_rel_diff")
                if k in rec]
        diff = " diff " + " ".join(f"{k.removesuffix('_rel_diff')}={rec[k]:.1e}" for k in keys)
    return f"{head} {rec['time_ms']:9.2f} ms{ratio} {rec['tflops']:7.1f} TFLOP/s{mem}{diff}"
