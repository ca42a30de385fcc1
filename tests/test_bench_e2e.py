"""``logitless bench --e2e`` on CPU: one GRPO training step of a tiny Qwen2 through
``trl.GRPOTrainer`` and through ``LogitlessGRPOTrainer``; the JSON's numbers are checked against
values computed here (the GRPO loss formula, the parameter count of the architecture, the
doubling search's arithmetic), and TRL's own loss is the oracle of logitless's."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("trl")

from logitless.bench import e2e
from logitless.cli import main

PROMPT, LENGTHS, BATCHES, CAP = 8, (16, 48), (1, 3), 200


@pytest.fixture(scope="module")
def e2e_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("e2e")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)  # the default --out is ./bench_out
        rc = main(["bench", "--e2e", "--device", "cpu", "--completion-lengths", ",".join(map(str, LENGTHS)),
                   "--batch-sizes", ",".join(map(str, BATCHES)), "--prompt-length", str(PROMPT),
                   "--max-tokens", str(CAP), "--reps", "2", "--seed", "3", "--zero-advantage-fractions", "0.5"])
    assert rc == 0
    (path,) = (cwd / "bench_out" / "benchmarks" / "results").glob("*-e2e-*.json")
    return cwd, json.loads(path.read_text())


def _qwen2_params(h: int, v: int, layers: int, inter: int, heads: int, kv_heads: int) -> int:
    kv = h // heads * kv_heads
    attn = (h * h + h) + 2 * (h * kv + kv) + h * h  # q, k, v with bias; o without
    return 2 * v * h + h + layers * (attn + 3 * h * inter + 2 * h)  # untied head, final norm, 2 norms per layer


def test_record_describes_the_run(e2e_run):
    _, run = e2e_run
    assert run["kind"] == "e2e" and run["device"]["type"] == "cpu" and run["settings"]["dtype"] == "float32"
    (m,) = run["models"]
    assert m["model"] == "tiny-qwen2"
    assert m["params"] == _qwen2_params(m["hidden_size"], m["vocab_size"], m["layers"], inter=64, heads=4,
                                        kv_heads=2)
    assert len(m["steps"]) == len(e2e.PATHS) * len(LENGTHS) * len(BATCHES)
    assert {s["path"] for s in m["steps"]} == {"trl", "logitless", "trl-logits"}


def test_each_step_is_timed_and_its_loss_is_the_on_policy_grpo_loss(e2e_run):
    _, run = e2e_run
    (m,) = run["models"]
    for s in m["steps"]:
        b, c = s["batch_size"], s["completion_length"]
        assert s["status"] == "ok", s
        assert s["tokens"] == b * (PROMPT + c)
        assert b * c // 2 <= s["completion_tokens"] <= b * c
        assert s["time_ms"] > 0 and len(s["times_ms"]) == 2 and all(t > 0 for t in s["times_ms"])
        assert s["saved_bytes"] > 0 and "peak_bytes" not in s  # no GPU: no peak allocator statistics
        # On-policy (old log-probs = the current ones, detached): every ratio is 1, so the dapo loss is
        # -sum_i A_i * n_i / sum_i n_i whatever the weights; both paths must give it.
        batch = e2e.make_batch(b, PROMPT, c, m["vocab_size"], torch.device("cpu"), 3 + b * c)
        mask = batch["completion_mask"].double()
        expected = float(-(batch["advantages"].double()[:, None] * mask).sum() / mask.sum())
        assert int(mask.sum()) == s["completion_tokens"]
        assert abs(s["loss"] - expected) < 1e-6, (s, expected)


def test_logitless_step_equals_trls(e2e_run):
    _, run = e2e_run
    p = run["models"][0]["parity"]
    b, c = p["batch_size"], p["completion_length"]
    assert (b, c) == (min(BATCHES), min(LENGTHS))
    assert abs(p["logitless_loss"] - p["trl_loss"]) < 1e-5 and p["loss_abs_diff"] < 1e-5
    assert p["grad_norm_rel_diff"] < 1e-5 and p["head_grad_rel_diff"] < 1e-4
    assert p["trl_grad_norm"] > 0
    # TRL 1.15's materialized-logits path: the same loss and gradient on an fp32 model.
    assert abs(p["trl-logits_loss"] - p["trl_loss"]) < 1e-5
    assert abs(p["trl-logits_grad_norm"] - p["trl_grad_norm"]) < 1e-5 * p["trl_grad_norm"]
    # Off-policy old log-probs: the loss now depends on the log-probs (not the on-policy value).
    batch = e2e.make_batch(b, PROMPT, c, run["models"][0]["vocab_size"], torch.device("cpu"), 3)
    mask = batch["completion_mask"].double()
    on_policy = float(-(batch["advantages"].double()[:, None] * mask).sum() / mask.sum())
    assert abs(p["trl_loss"] - on_policy) > 1e-4


def test_largest_micro_batch_search_doubles_to_the_cap(e2e_run):
    _, run = e2e_run
    fits = []
    c = min(LENGTHS)
    while PROMPT + c <= CAP:
        fits.append(PROMPT + c)
        c *= 2
    for path in e2e.PATHS:
        f = run["models"][0]["max_fit"][path]
        assert [t["tokens"] for t in f["tried"]] == fits
        assert f["max_fit_tokens"] == fits[-1] and f["max_fit_completion_length"] == fits[-1] - PROMPT
        assert f["capped"] is True and f["first_oom_tokens"] is None


def test_report_has_the_e2e_section(e2e_run):
    cwd, _ = e2e_run
    md = (cwd / "bench_out" / "BENCHMARKS.md").read_text()
    assert "End-to-end GRPO step" in md and "tiny-qwen2" in md and "Largest micro-batch that fits" in md
    assert "SGD without momentum" in md and "| 3 × 48 |" in md
    assert not (cwd / "BENCHMARKS.md").exists()  # nothing written into the working directory itself


def test_skip_rows_remove_zero_advantage_completions_and_equal_trls_step(e2e_run):
    """The logitless-skip rows (half the advantages 0: at batch 1 the one completion, so one row
    runs times 0) give the on-policy loss of the batch with those advantages zeroed, and the
    skip step's loss and every gradient equal TRL's on the same weights at fp32 accuracy."""
    _, run = e2e_run
    (m,) = run["models"]
    assert len(m["skip_steps"]) == len(LENGTHS) * len(BATCHES)
    for s in m["skip_steps"]:
        b, c = s["batch_size"], s["completion_length"]
        assert s["status"] == "ok" and s["path"] == "logitless-skip" and s["zero_advantage_fraction"] == 0.5
        assert s["zero_rows"] == int(0.5 * b + 0.5) and s["time_ms"] > 0
        batch, zero = e2e.with_zero_advantages(
            e2e.make_batch(b, PROMPT, c, m["vocab_size"], torch.device("cpu"), 3 + b * c), 0.5)
        assert zero == s["zero_rows"] and int((batch["advantages"] == 0).sum()) == zero
        mask = batch["completion_mask"].double()
        expected = float(-(batch["advantages"].double()[:, None] * mask).sum() / mask.sum())
        assert abs(s["loss"] - expected) < 1e-6, (s, expected)
    (p,) = m["skip_parity"]
    assert (p["batch_size"], p["completion_length"], p["zero_rows"]) == (max(BATCHES), min(LENGTHS), 2)
    assert p["loss_abs_diff"] < 1e-5 and p["grad_rel_diff"] < 1e-4 and abs(p["trl_loss"]) > 0
    cwd, _ = e2e_run
    md = (cwd / "bench_out" / "BENCHMARKS.md").read_text()
    assert "skip_zero_advantage=True" in md and "| 3 × 48 | 50% (2 of 3) |" in md
