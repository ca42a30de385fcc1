"""A/B of the first statistics GEMM launched before the value checks' read (``engine.start_pass``):
a bench row with it and without it, interleaved, each as a ratio to the row's floor timed in the
same round, from a synchronization and queued in a step (GPU only).

    python3 scripts/gpu_start_ab.py SHAPE OBJECTIVE [OBJECTIVE ...]
    python3 scripts/gpu_start_ab.py 8k:llama3-8b grpo dpo
"""

from __future__ import annotations

import statistics
import sys

import torch

from logitless.bench.batches import group_inputs, is_group_objective
from logitless.bench.cases import make_inputs, parse_shape
from logitless.bench.competitors import rows_of
from logitless.bench.timing import time_in_step, time_step
from logitless.ops import engine
from logitless.ops.plan import started_rows

ROUNDS = 3


def main() -> None:
    case = parse_shape(sys.argv[1])
    dev = torch.device("cuda")
    x0 = make_inputs(case, dev, torch.bfloat16)
    for objective in sys.argv[2:]:
        x = group_inputs(x0, objective) if is_group_objective(objective) else x0
        rows = {r.name: r for r in rows_of(objective)}
        name = "logitless-fused" if "logitless-fused" in rows else "logitless"
        floor = rows["floor"].prepare(x, "auto")
        ours = rows[name].prepare(x, "auto")

        def reset(x=x) -> None:
            x.hidden.grad = x.weight.grad = None

        for prepared in (floor, ours, ours):
            reset()
            prepared.step()
        got: dict[str, list[float]] = {"on sync": [], "off sync": [], "on step": [], "off step": []}
        for _ in range(ROUNDS):
            base = time_step(floor.step, reset, dev).median_ms
            base_step = time_in_step(floor.step, reset, dev).median_ms
            for label, rows_fn in (("on", started_rows), ("off", lambda *a: 0)):
                engine.started_rows = rows_fn
                got[f"{label} sync"].append(time_step(ours.step, reset, dev).median_ms / base)
                got[f"{label} step"].append(time_in_step(ours.step, reset, dev).median_ms / base_step)
            engine.started_rows = started_rows
        print(f"{case.model} {case.n_tokens} {objective} {name} (started rows "
              f"{started_rows(case.n_tokens, case.hidden_size, case.vocab_size)}): "
              + ", ".join(f"{k} {statistics.median(v):.3f} [{min(v):.3f}-{max(v):.3f}]" for k, v in got.items()))


if __name__ == "__main__":
    main()
