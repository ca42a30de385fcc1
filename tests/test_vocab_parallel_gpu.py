"""Vocabulary-parallel heads over NCCL: TP2 and TP4 (one process per GPU, uneven shards) give
TP1's loss, per-token log-probs, entropy and gradients (``d hidden``, each rank's ``d weight``
rows), bf16 inputs on the default (GPU) backend.

The oracle is float64 on the whole head (the torch backend); a TP result must be as accurate
as TP1 (within 1.5x TP1's own error against it) and equal TP1 within that error (3x). The
gloo case runs the same worker on the CPU at a tiny shape, so the GPU cases cannot fail on a
harness error.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import dist_worker
from gloo_ranks import run_ranks

# fp32-accumulated quantities (loss, log-probs, entropy) can have a TP1 error near 0; a TP
# result then differs by a few fp32 roundings of the statistics. Gradients are bf16.
_FLOOR = {"loss": 3e-5, "logp": 1e-5, "entropy": 1e-5, "d hidden": 1e-4, "d weight": 1e-4}

# GPU: V prime (uneven shards, no tile size divides a shard), 2k tokens, a head of 1k;
# CPU: the same worker at a tiny shape.
_SHAPES = {"nccl": dict(device="cuda", b=8, t=256, h=1024, v=32011),
           "gloo": dict(device="cpu", b=4, t=16, h=32, v=251)}


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize(("backend", "world"), [
    pytest.param("nccl", 2, marks=[pytest.mark.cuda, pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs")]),
    pytest.param("nccl", 4, marks=[pytest.mark.cuda, pytest.mark.skipif(_gpus() < 4, reason="needs 4 GPUs")]),
    pytest.param("gloo", 2),
])
def test_vocab_parallel_equals_tp1(backend, world, seed):
    case = dict(_SHAPES[backend], seed=seed)
    outs = run_ranks(dist_worker.tp_against_tp1, world, case, timeout_s=300, backend=backend)
    assert sum(o["rows"] for o in outs) == case["v"]
    bad = []
    for rank, o in enumerate(outs):
        assert set(o["runs"]) == {name for name, _, _ in dist_worker.TP_RUNS}
        for run, quantities in o["runs"].items():
            for q, e in quantities.items():
                floor = _FLOOR[q]
                if not (e["tp_64"] <= 1.5 * e["tp1_64"] + floor and e["tp_tp1"] <= 3 * e["tp1_64"] + floor):
                    bad.append(f"rank {rank} {run} {q}: {e}")
    assert not bad, "\n".join(bad)
