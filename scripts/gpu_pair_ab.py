"""Fused GRPO with ``d weight`` held as the bf16 pair against the fp32 accumulator, interleaved
on one GPU (bench inputs and timing), with the gradients' difference between the two.

    python3 scripts/gpu_pair_ab.py SHAPE [SHAPE ...] [--objective grpo|ce|distill|jsd]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from logitless.bench.cases import make_inputs, parse_shape
from logitless.bench.competitors import ROWS
from logitless.bench.timing import rel_diff, time_step
from logitless.ops import distill, fused


def _set_pairs(on: bool) -> None:
    for cls in (fused.SoftmaxPass, distill.DistillPass):
        cls.pairs_weight_grad = property(lambda p, on=on: on and p.stores_weight_grad)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="+")
    ap.add_argument("--objective", default="grpo")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    for shape in args.shapes:
        _one(shape, args.objective, args.rounds)
        torch.cuda.empty_cache()


def _one(shape: str, objective: str, rounds: int) -> None:
    x = make_inputs(parse_shape(shape), torch.device("cuda"), torch.bfloat16)
    name = "logitless-fused" if objective in ("grpo", "ce") else "logitless"
    prep = next(r for r in ROWS if r.objective == objective and r.name == name).prepare(x, "auto")

    def reset() -> None:
        x.hidden.grad = x.weight.grad = None

    times: dict[bool, list[float]] = {True: [], False: []}
    grads = {}
    for _ in range(rounds):
        for on in (True, False):
            _set_pairs(on)
            reset()
            prep.step()  # warm-up and the gradients
            grads[on] = x.weight.grad.clone()
            times[on] += time_step(prep.step, reset, x.hidden.device, min_reps=2, max_reps=2).times_ms
    print(f"{objective} {shape}: pair {statistics.median(times[True]):.2f} ms, fp32 accumulator "
          f"{statistics.median(times[False]):.2f} ms; d weight rel diff {rel_diff(grads[True], grads[False]):.2e}",
          flush=True)


if __name__ == "__main__":
    main()
