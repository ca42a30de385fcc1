"""`logitless demo` end to end at a reduced size (the README's first command runs it full size)."""

from __future__ import annotations

import json

from logitless.cli import main


def test_demo_small(tmp_path, capsys):
    rc = main(["demo", "--steps", "3", "--vocab-size", "1024", "--hidden-size", "32", "--completion-length", "6",
               "--generations", "4", "--memory-tokens", "1024", "--device", "cpu", "--output-dir", str(tmp_path)])
    assert rc == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(summary["rewards"]) == 3
    assert all(0.0 <= r <= 1.0 for r in summary["rewards"])
    one = summary["one_step"]
    # Same inputs through logitless and through TRL's own head and loss: same numbers (fp32).
    assert abs(one["logitless"]["loss"] - one["trl"]["loss"]) <= 1e-6
    assert one["grad_rel_l2_diff"] <= 1e-5
    assert one["trl"]["grad_norm"] > 0
    assert summary["head_peak_bytes"]["plain"] > 0
    assert (tmp_path / "reward.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert "reward (mean of first" in out and "TRL 1.16 own path" in out
