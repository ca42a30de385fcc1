"""A/B of one engine feature: a bench row with it and without it, interleaved, each as a ratio to
the row's floor timed in the same round, from a synchronization and queued in a step, and each
one's peak memory beyond the inputs (GPU only). The features (``SWITCHES``):

* ``started``: the first statistics GEMM launched before the value checks' read
  (``engine.start_pass``);
* ``leading``: a policy loss's rows with a gradient first, the gradient chunks planned for them
  alone (``planning.leading_rows``);
* ``deferred``: a policy loss's value checks queued behind its pass's first statistics GEMM and
  read at the end of the call (``ops.defers_checks``);
* ``fold``: a policy loss without an entropy bonus keeps its fused chunks' logits as scaled
  probabilities, which its gradient GEMMs read with no ``dy`` pass (``StatRequest.logp_grad_only``);
* ``fold-pref``: the same for the fused preference losses;
* ``two-part``: the policy, fused preference, cross-entropy and rollout calls start a first part
  of their statistics GEMM before they build their value checks and a second after the send (off:
  one part, after the send).

    python3 scripts/gpu_ab.py FEATURE SHAPE OBJECTIVE [OBJECTIVE ...]
    python3 scripts/gpu_ab.py started 8k:llama3-8b grpo dpo
    python3 scripts/gpu_ab.py leading 8k:gemma2-2b grpo-c25 grpo-c50 grpo
    PROFILE=1 ...   # also each one's GPU timeline, with and without
"""

from __future__ import annotations

import importlib
import os
import statistics
import sys

import torch

from logitless.bench.batches import group_inputs, is_group_objective
from logitless.bench.cases import make_inputs, parse_shape
from logitless.bench.competitors import rows_of
from logitless.bench.timing import time_in_step, time_step
from logitless.objectives import policy, preference_fused
from logitless.ops import StatRequest, engine


def _second_part_only(*args, **kwargs):
    """``start_pass`` as a one-part caller had it: nothing before the send, then the first rows."""
    return engine.start_pass(*args, **kwargs) if "after" in kwargs else None


# feature -> [(module, attribute, its value with the feature off), ...]
SWITCHES = {
    "started": [(engine, "started_rows", lambda *a: 0)],
    "leading": [(policy, "_gradient_first", lambda *a: None)],
    "deferred": [(policy, "defers_checks", lambda *a: False)],
    "fold": [(policy, "_want", lambda cfg: StatRequest(entropy=True))],
    "fold-pref": [(preference_fused, "_want",
                   lambda token_sums=False, weighted=False: StatRequest(entropy=True, sum_z=token_sums,
                                                                        sum_sq=weighted))],
    "two-part": [(policy, "start_pass", _second_part_only), (preference_fused, "start_pass", _second_part_only),
                 (importlib.import_module("logitless.objectives.vocab_stats"), "start_pass", _second_part_only)],
}

ROUNDS = int(os.environ.get("ROUNDS", 3))


def _timeline(step, reset, dev, label: str) -> None:
    """One call under torch.profiler: its kernels over 40 us and idle gaps over 40 us, in order."""
    from torch.profiler import ProfilerActivity, profile

    reset()
    torch.cuda.synchronize(dev)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize(dev)
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    t0, last = ev[0].time_range.start, ev[0].time_range.start
    print(f"  {label}: {len(ev)} GPU ops, {(ev[-1].time_range.end - t0) / 1e3:.2f} ms")
    for e in ev:
        gap = e.time_range.start - last
        if gap > 40:
            print(f"    {(last - t0) / 1e3:8.3f}  idle {gap / 1e3:.3f} ms")
        if e.time_range.elapsed_us() > 40:
            at, took = (e.time_range.start - t0) / 1e3, e.time_range.elapsed_us() / 1e3
            print(f"    {at:8.3f}  {took:7.3f} ms  {e.name[:90]}")
        last = max(last, e.time_range.end)


def _peak_gib(step, reset, dev) -> float:
    """Peak memory of one call beyond what was allocated before it, in GiB."""
    reset()
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    step()
    torch.cuda.synchronize(dev)
    return (torch.cuda.max_memory_allocated(dev) - before) / 2**30


def main() -> None:
    patches = [(module, attr, getattr(module, attr), off) for module, attr, off in SWITCHES[sys.argv[1]]]

    def switch(feature_on: bool) -> None:
        for module, attr, on, off in patches:
            setattr(module, attr, on if feature_on else off)
    case = parse_shape(sys.argv[2])
    dev = torch.device("cuda")
    x0 = make_inputs(case, dev, torch.bfloat16)
    for objective in sys.argv[3:]:
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
            for label in ("on", "off"):
                switch(label == "on")
                got[f"{label} sync"].append(time_step(ours.step, reset, dev).median_ms / base)
                got[f"{label} step"].append(time_in_step(ours.step, reset, dev).median_ms / base_step)
            switch(True)
        peaks = {}
        for label in ("on", "off"):
            switch(label == "on")
            peaks[label] = _peak_gib(ours.step, reset, dev)
            if os.environ.get("PROFILE"):
                _timeline(ours.step, reset, dev, label)
        switch(True)
        print(f"{case.model} {case.n_tokens} {objective} {name} ({sys.argv[1]}; backend "
              f"{engine.resolve_backend('auto', x.hidden).NAME}): "
              + ", ".join(f"{k} {statistics.median(v):.3f} [{min(v):.3f}-{max(v):.3f}]" for k, v in got.items())
              + f"; peak GiB on {peaks['on']:.2f} off {peaks['off']:.2f}")


if __name__ == "__main__":
    main()
