"""``logitless bench`` on CPU: the quick run writes a JSON with every row, agreement numbers
that say "same numbers", and a regenerated BENCHMARKS.md + plot in the output folder (never
the repository's own)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from logitless.bench import report
from logitless.bench.cases import Case, Inputs, make_inputs, parse_shape
from logitless.bench.competitors import ROWS, Unavailable

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[Path, dict, str]:
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run([sys.executable, "-m", "logitless.bench", "--device", "cpu", "--quick", "--out-dir",
                           str(out)], cwd=out, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = list((out / "benchmarks" / "results").glob("*.json"))
    assert len(files) == 1, files
    return out, json.loads(files[0].read_text()), proc.stdout + proc.stderr


def _rec(case: dict, objective: str, row: str) -> dict:
    (rec,) = [r for r in case["results"] if r["objective"] == objective and r["row"] == row]
    return rec


def test_json_has_every_row_and_timings(quick_run):
    _, run, _ = quick_run
    assert run["device"]["type"] == "cpu"
    assert len(run["cases"]) == 2
    must = {"grpo": ["floor", "logitless-fused", "logitless-recompute", "torch-plain"],
            "ce": ["floor", "logitless-fused", "logitless-recompute", "torch-plain"],
            "rollout": ["floor", "logitless", "torch-plain"],
            "distill": ["floor", "logitless", "torch-plain"],
            "jsd": ["floor", "logitless", "torch-plain"],
            "dpo": ["floor", "logitless-fused", "logitless-recompute", "logitless-fused-bf16", "torch-plain"],
            "kto": ["floor", "logitless-fused", "logitless-recompute", "logitless-fused-bf16", "torch-plain"],
            "simpo": ["floor", "logitless-fused", "logitless-recompute", "logitless-fused-bf16", "torch-plain"]}
    if importlib.util.find_spec("trl") is not None:
        for rows in must.values():
            rows.append("trl-chunked")
    for case in run["cases"]:
        assert abs(case["mean_entropy"] - 2.0) < 0.3, case["mean_entropy"]  # calibrated, not uniform (~log V)
        for objective, rows in must.items():
            for row in rows:
                rec = _rec(case, objective, row)
                assert rec["status"] == "ok", rec
                assert rec["time_ms"] > 0 and rec["tflops"] > 0 and math.isfinite(rec["ratio_to_floor"])
        for objective, row in (("grpo", "liger"), ("ce", "cce"), ("ce", "torch-compile"), ("dpo", "liger"),
                               ("dpo", "torch-compile"), ("kto", "liger"), ("kto", "torch-compile"),
                               ("simpo", "liger"), ("simpo", "torch-compile")):  # recorded, with why
            rec = _rec(case, objective, row)
            assert rec["status"] == "skipped" and rec["reason"]


def test_console_says_cpu_is_not_representative_and_prints_no_nan(quick_run):
    _, run, console = quick_run
    assert "not representative" in console
    table = report.console_table(run)
    assert "nan" not in table.lower()
    ref_lines = [ln for ln in table.splitlines() if " logitless-fused " in ln and ln.strip().startswith("grpo")]
    assert ref_lines and all(ln.rstrip().endswith("(reference)") for ln in ref_lines)


def test_rows_agree_with_logitless(quick_run):
    _, run, _ = quick_run
    for case in run["cases"]:
        for objective in ("grpo", "ce"):
            rec = _rec(case, objective, "logitless-recompute")  # same fp32 math on CPU: same numbers
            assert rec["loss_rel_diff"] < 1e-5 and rec["grad_hidden_rel_diff"] < 1e-5, rec
            plain = _rec(case, objective, "torch-plain")  # bf16 logits: bf16-sized differences
            assert plain["agrees"] is True, plain
            assert 0 < plain["grad_weight_rel_diff"] < 5e-2
        assert _rec(case, "rollout", "torch-plain")["logp_rel_diff"] < 1e-2
        for objective in ("dpo", "kto", "simpo"):
            assert _rec(case, objective, "torch-plain")["agrees"] is True
            assert _rec(case, objective, "logitless-recompute")["loss_rel_diff"] < 1e-5  # same fp32 math
        for objective in ("distill", "jsd"):  # each plain row computes its own divergence
            plain = _rec(case, objective, "torch-plain")
            assert plain["agrees"] is True and 0 < plain["loss_rel_diff"] < 5e-2, plain


def test_report_regenerated_in_out_dir_only(quick_run):
    out, run, _ = quick_run
    md = (out / "BENCHMARKS.md").read_text()
    assert "logitless-fused" in md and "benchmarks/bench.png" in md and "Same numbers" in md
    assert (out / "benchmarks" / "bench.png").stat().st_size > 1000
    # --report-only regenerates from every JSON present (here: a second copy of the run).
    second = dict(run, timestamp="2000-01-01T00:00:00Z")
    report.write_json(second, out / "benchmarks" / "results")
    proc = subprocess.run([sys.executable, "-m", "logitless.bench", "--report-only", "--out-dir", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    md2 = (out / "BENCHMARKS.md").read_text()
    assert "2 JSON file(s)" in md2 and "2000-01-01T00:00:00Z" in md2


def test_shapes_parse_and_reject():
    assert parse_shape("8k:qwen2.5-7b") == Case("qwen2.5-7b", 8192, 3584, 151936)
    assert parse_shape("256:64x1000").vocab_size == 1000
    for bad in ("8k", "8k:nope", "0:tiny-a", "102:tiny-a"):
        with pytest.raises(ValueError):
            parse_shape(bad)


def test_inputs_are_realistic():
    x = make_inputs(parse_shape("256:96x1531"), torch.device("cpu"), torch.bfloat16, target_entropy=1.5)
    assert abs(x.true_entropy - 1.5) < 0.3  # uniform random heads would give ~log V = 7.3 nats
    assert x.hidden.shape == (4, 64, 96) and x.hidden.requires_grad and x.weight.requires_grad
    assert int(x.targets.max()) < 1531 and bool((x.old_logp <= 0).all())


# ---------------------------------------------------------------- DPO rows against a float64 oracle

_DPO_BETA = 0.1


def _dpo_oracle(x: Inputs) -> tuple[float, torch.Tensor, torch.Tensor]:
    """DPO sigmoid loss (chosen = first half of the rows) from float64 materialized logits, and its
    gradients w.r.t. hidden and weight."""
    h = x.hidden.detach().double().requires_grad_(True)
    w = x.weight.detach().double().requires_grad_(True)
    logp = torch.log_softmax(h @ w.t(), dim=-1).gather(-1, x.targets[..., None]).squeeze(-1)
    pc, pr = (logp * x.mask).sum(-1).chunk(2)
    rc, rr = (x.ref_logp.double() * x.mask).sum(-1).chunk(2)
    loss = -F.logsigmoid(_DPO_BETA * ((pc - rc) - (pr - rr))).mean()
    loss.backward()
    return float(loss.detach()), h.grad, w.grad


def _run_dpo_row(name: str, x: Inputs) -> tuple[float, torch.Tensor, torch.Tensor]:
    (row,) = [r for r in ROWS if r.objective == "dpo" and r.name == name]
    x.hidden.grad = x.weight.grad = None
    out = row.prepare(x, "auto").step()
    return float(out["loss"]), x.hidden.grad.double(), x.weight.grad.double()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def dpo_case() -> tuple[Inputs, tuple[float, torch.Tensor, torch.Tensor]]:
    # float32 inputs (the bench's --dtype float32): fp32 logits, so only summation order separates the rows
    # from float64.
    x = make_inputs(parse_shape("128:tiny-a"), torch.device("cpu"), torch.float32)
    assert x.targets.shape[0] % 2 == 0
    return x, _dpo_oracle(x)


@pytest.mark.parametrize("row", ["logitless-fused", "logitless-recompute", "torch-plain"])
def test_dpo_rows_match_float64_oracle(dpo_case, row):
    x, (loss64, gh64, gw64) = dpo_case
    loss, gh, gw = _run_dpo_row(row, x)
    assert abs(loss - loss64) <= 1e-5 * abs(loss64), (loss, loss64)
    assert _rel(gh, gh64) < 1e-4 and _rel(gw, gw64) < 1e-4


def test_dpo_trl_row_matches_float64_oracle(dpo_case):
    pytest.importorskip("trl.kernels.chunked_logprob", reason="trl is not installed: no TRL row to check")
    x, (loss64, gh64, gw64) = dpo_case
    loss, gh, gw = _run_dpo_row("trl-chunked", x)
    assert abs(loss - loss64) <= 1e-5 * abs(loss64), (loss, loss64)
    assert _rel(gh, gh64) < 1e-4 and _rel(gw, gw64) < 1e-4


def test_dpo_rejects_an_odd_batch(dpo_case):
    x, _ = dpo_case
    odd = replace(x, hidden=x.hidden.detach()[:3].requires_grad_(True), targets=x.targets[:3], mask=x.mask[:3],
                  ref_logp=x.ref_logp[:3])
    (row,) = [r for r in ROWS if r.objective == "dpo" and r.role == "reference"]
    with pytest.raises(ValueError, match="even number of sequences"):
        row.prepare(odd, "auto")


def test_dpo_cuda_only_rows_say_why_on_cpu(dpo_case):
    x, _ = dpo_case
    for name in ("liger", "torch-compile"):
        (row,) = [r for r in ROWS if r.objective == "dpo" and r.name == name]
        with pytest.raises(Unavailable, match="CUDA"):
            row.prepare(x, "auto")


# ---------------------------------------------------------------- KTO and SimPO rows against float64


def _kto_oracle(x: Inputs) -> tuple[float, torch.Tensor, torch.Tensor]:
    """KTO (``kto``, beta 0.1; every other row desirable; the bench's reference sums and KL
    estimate) from float64 materialized logits, and its gradients."""
    from logitless.bench.competitors import _kto_batch

    k = _kto_batch(x)
    h = x.hidden.detach().double().requires_grad_(True)
    w = x.weight.detach().double().requires_grad_(True)
    logp = torch.log_softmax(h @ w.t(), dim=-1).gather(-1, x.targets[..., None]).squeeze(-1)
    ratio = (logp * x.mask).sum(-1) - k.ref_logps.double()
    kl = k.kl.double()
    per = torch.where(k.label, 1 - torch.sigmoid(0.1 * (ratio - kl)), 1 - torch.sigmoid(0.1 * (kl - ratio)))
    loss = per.mean()
    loss.backward()
    return float(loss.detach()), h.grad, w.grad


def _simpo_oracle(x: Inputs) -> tuple[float, torch.Tensor, torch.Tensor]:
    """SimPO (beta 2, gamma 0.5, per-token mean log-probs; chosen = first half of the rows) from
    float64 materialized logits, and its gradients."""
    h = x.hidden.detach().double().requires_grad_(True)
    w = x.weight.detach().double().requires_grad_(True)
    logp = torch.log_softmax(h @ w.t(), dim=-1).gather(-1, x.targets[..., None]).squeeze(-1)
    c, r = ((logp * x.mask).sum(-1) / x.mask.sum(-1)).chunk(2)
    loss = -F.logsigmoid(2.0 * (c - r) - 0.5).mean()
    loss.backward()
    return float(loss.detach()), h.grad, w.grad


@pytest.fixture(scope="module")
def preference_cases(dpo_case) -> dict[str, tuple[float, torch.Tensor, torch.Tensor]]:
    x, _ = dpo_case
    return {"kto": _kto_oracle(x), "simpo": _simpo_oracle(x)}


@pytest.mark.parametrize("objective", ["kto", "simpo"])
@pytest.mark.parametrize("row", ["logitless-fused", "logitless-recompute", "torch-plain", "trl-chunked"])
def test_kto_simpo_rows_match_float64_oracle(dpo_case, preference_cases, objective, row):
    if row == "trl-chunked":
        pytest.importorskip("trl.kernels.chunked_logprob", reason="trl is not installed: no TRL row to check")
    x, _ = dpo_case
    loss64, gh64, gw64 = preference_cases[objective]
    (r,) = [r for r in ROWS if r.objective == objective and r.name == row]
    x.hidden.grad = x.weight.grad = None
    loss = float(r.prepare(x, "auto").step()["loss"])
    assert abs(loss - loss64) <= 1e-5 * abs(loss64), (loss, loss64)
    assert _rel(x.hidden.grad.double(), gh64) < 1e-4 and _rel(x.weight.grad.double(), gw64) < 1e-4


@pytest.mark.parametrize("objective", ["kto", "simpo"])
def test_kto_simpo_cuda_only_rows_say_why_on_cpu(dpo_case, objective):
    x, _ = dpo_case
    for name in ("liger", "torch-compile"):
        (row,) = [r for r in ROWS if r.objective == objective and r.name == name]
        with pytest.raises(Unavailable, match="CUDA"):
            row.prepare(x, "auto")


def test_in_step_timing_is_cuda_only():
    from logitless.bench.timing import time_in_step

    assert time_in_step(lambda: None, lambda: None, torch.device("cpu")) is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_in_step_timing_hides_host_work_before_a_read_only(seed):
    """Queued behind other GPU work, a call's host work before its first kernel no longer counts;
    host work after a read of the device (which waits for the queue) still does."""
    import time

    from logitless.bench.timing import time_in_step, time_step

    dev = torch.device("cuda")
    x = torch.randn(2048, 2048, device=dev)

    def prepares_then_computes():
        time.sleep(0.004)
        x @ x

    def reads_then_prepares():
        float(x[0, 0])
        time.sleep(0.004)
        x @ x

    prepares_then_computes()
    torch.cuda.synchronize()
    from_sync = time_step(prepares_then_computes, lambda: None, dev, min_reps=5).median_ms
    in_step = time_in_step(prepares_then_computes, lambda: None, dev).median_ms
    assert from_sync - in_step > 3.0, (from_sync, in_step)
    assert time_in_step(reads_then_prepares, lambda: None, dev).median_ms > 3.5
