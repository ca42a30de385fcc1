"""Logits are never materialized: peak resident memory of a fresh process stays far below the
size of the ``[N, V]`` logits the plain path would allocate.

Each case runs in a subprocess so that ``ru_maxrss`` (the process's high-water mark, imports
included) measures this computation alone. The head is thin (``H = 8``) so that the cost is
the ``N·V`` logits themselves, the quantity under test; a few rows are checked against the
float64 materialized reference so that the big call is known to have computed the right thing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

GiB = 2**30

_SCRIPT = textwrap.dedent("""
    import json, resource, sys
    import torch
    from logitless import PassOptions, token_logprobs, vocab_stats
    from logitless.objectives.reference import reference_stats

    case, n, v, h = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    chunk = None if sys.argv[5] == "default" else int(sys.argv[5])
    torch.manual_seed(n + v)
    hidden = torch.randn(n, h)
    weight = torch.randn(v, h) * 0.5
    targets = torch.randint(0, v, (n,))
    rows = torch.randperm(n)[:16]
    if case == "logprobs":
        logp = token_logprobs(hidden, weight, targets, options=PassOptions(chunk_bytes=chunk))
        ref = reference_stats(hidden[rows], weight, targets[rows]).logp
        err = (logp[rows].double() - ref).abs().max().item()
    else:
        hidden.requires_grad_(True)
        weight.requires_grad_(True)
        g = torch.randn(3, n)
        st = vocab_stats(hidden, weight, targets, options=PassOptions(chunk_bytes=chunk))
        (g[0] * st.logp + g[1] * st.lse + g[2] * st.entropy).sum().backward()
        # Gradient of the sampled rows: their terms alone, through the materialized reference.
        hr = hidden.detach()[rows].double().requires_grad_(True)
        ref = reference_stats(hr, weight.detach(), targets[rows])
        (g[0, rows] * ref.logp + g[1, rows] * ref.lse + g[2, rows] * ref.entropy).sum().backward()
        err = max((st.logp[rows].double() - ref.logp).abs().max().item(),
                  (hidden.grad[rows].double() - hr.grad).abs().max().item())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    print(json.dumps({"peak_bytes": peak, "max_err": err}))
""")


def _run(case: str, n: int, v: int, h: int, chunk_bytes: int | None) -> dict:
    args = [case, str(n), str(v), str(h), "default" if chunk_bytes is None else str(chunk_bytes)]
    out = subprocess.run([sys.executable, "-c", _SCRIPT, *args], capture_output=True,
                         text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("chunk_bytes", [4 * 2**20])
def test_token_logprobs_beyond_machine_memory(chunk_bytes):
    # fp32 logits of 50,000 x 131,072 are 26.2 GB (> 24 GiB: more than this machine's RAM).
    n, v, h = 50_000, 131_072, 8
    assert n * v * 4 > 24 * GiB
    res = _run("logprobs", n, v, h, chunk_bytes)
    assert res["max_err"] < 1e-4
    assert res["peak_bytes"] < 2 * GiB, f"peak RSS {res['peak_bytes'] / GiB:.2f} GiB"


@pytest.mark.parametrize("chunk_bytes", [None])  # the default budget (1 GiB)
def test_vocab_stats_forward_backward_bounded(chunk_bytes):
    # fp32 logits of 8,192 x 131,072 are 4.3 GB; forward and backward (recompute) stay under 1.5 GiB.
    n, v, h = 8_192, 131_072, 8
    assert n * v * 4 > 4e9
    res = _run("stats", n, v, h, chunk_bytes)
    assert res["max_err"] < 1e-4
    assert res["peak_bytes"] < 1.5 * GiB, f"peak RSS {res['peak_bytes'] / GiB:.2f} GiB"


def test_head_workspace_no_larger_than_the_materialized_path():
    """The demo's own measurement (``logitless.demo.measure``: a fresh process per path, resident
    memory sampled) on a batch of the demo's CPU size, 192 tokens x SmolLM2's head (49152 x 576,
    fp32): the GRPO head through logitless peaks no higher than TRL's materialized-logits path."""
    import os
    import tempfile
    from pathlib import Path

    import torch

    from logitless.demo.measure import _HEAD_MEMORY

    g = torch.Generator().manual_seed(11)
    b, t, h, v = 8, 24, 576, 49152
    batch = {"hidden": torch.randn(b, t, h, generator=g), "weight": torch.randn(v, h, generator=g) * 0.05,
             "ids": torch.randint(0, v, (b, t), generator=g), "mask": (torch.rand(b, t, generator=g) > 0.1).float(),
             "adv": torch.randn(b, generator=g), "temperature": torch.tensor(0.9)}
    peaks = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "batch.pt"
        torch.save(batch, path)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"),
                                                             os.environ.get("PYTHONPATH", "")])}
        for mode in ("plain", "logitless"):
            r = subprocess.run([sys.executable, "-c", _HEAD_MEMORY, mode, str(path)], capture_output=True, text=True,
                               env=env, check=True, timeout=300)
            peaks[mode] = json.loads(r.stdout.strip().splitlines()[-1])["peak_bytes"]
    assert peaks["logitless"] <= peaks["plain"], peaks

