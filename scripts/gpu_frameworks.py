"""The RL frameworks' own head paths against logitless's adapters on one GPU: per-token
log-probs (and entropy) of bench inputs, forward + backward of ``sum(a·logp + b·entropy)``; time,
peak memory beyond the inputs, and each output's relative error against float64.

    pip install --no-deps -r requirements-frameworks.txt
    python3 scripts/gpu_frameworks.py 8k:llama3-8b 8k:qwen2.5-7b [--dtype bf16]

Rows (the frameworks' code is imported from the installed packages, as the CPU tests do):
  verl-triton       verl's Triton linear_cross_entropy (actor_rollout_ref.model.use_fused_kernels)
  verl-torch        verl's FusedLinearForPPO, torch backend
  logitless-verl    logitless.integrations.verl.linear_cross_entropy
  agilerl           AgileRL 2.58's fused log-prob function (grad path), log-probs only
  logitless-agilerl logitless.integrations.agilerl's function behind the same seam
  openrlhf          OpenRLHF's Actor.forward head: fp32 logits, log_probs_from_logits, compute_entropy
  logitless         logitless.vocab_stats with entropy (what the OpenRLHF adapter runs)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch._inductor.codecache  # before the frameworks load: OpenRLHF's compute_entropy is compiled

from logitless import Head, vocab_stats
from logitless.bench.cases import make_inputs, parse_shape
from logitless.bench.timing import is_oom, peak_bytes, rel_diff, time_step

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from framework_sources import module_file, package_modules

_OPEN: list = []  # framework import contexts kept open for the process (closing one unloads its modules)

Fn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


def _reference(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, a: torch.Tensor, b: torch.Tensor, chunk: int):
    """float64 log-probs, entropy and the gradients of sum(a·logp + b·entropy), token chunks."""
    w64 = w.double()
    logp, ent, dh = [], [], []
    dw = torch.zeros_like(w64)
    for s in range(0, h.shape[0], chunk):
        h64 = h[s : s + chunk].double()
        z = h64 @ w64.T
        lse = z.logsumexp(-1, keepdim=True)
        p = (z - lse).exp()
        e = lse.squeeze(-1) - (p * z).sum(-1)
        logp.append(z.gather(-1, t[s : s + chunk, None]).squeeze(-1) - lse.squeeze(-1))
        ent.append(e)
        onehot = torch.zeros_like(z).scatter_(-1, t[s : s + chunk, None], 1.0)
        dz = a[s : s + chunk, None] * (onehot - p) - b[s : s + chunk, None] * p * (z - lse + e[:, None])
        dh.append(dz @ w64)
        dw += dz.T @ h64
    return torch.cat(logp), torch.cat(ent), torch.cat(dh), dw


def _installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _rows() -> dict[str, Fn]:
    rows: dict[str, Fn] = {}
    if not all(_installed(n) for n in ("verl", "agilerl", "openrlhf")):
        print("frameworks missing: pip install --no-deps -r requirements-frameworks.txt")
    try:
        verl_tf = module_file("verl", "verl/utils/experimental/torch_functional.py")
        rows["verl-torch"] = lambda h, w, t: verl_tf.FusedLinearForPPO()(hidden_states=h, vocab_weights=w, input_ids=t)
        lce_ctx = package_modules("verl.utils.kernel.linear_cross_entropy", "verl.utils.kernel.kernels")
        _OPEN.append(lce_ctx)
        (lce, _) = lce_ctx.__enter__()
        rows["verl-triton"] = lambda h, w, t: lce.linear_cross_entropy(h, w, t, 1.0, "none")
    except Exception as e:
        print(f"verl rows unavailable: {e!r}")
    from logitless.integrations.verl import linear_cross_entropy

    rows["logitless-verl"] = lambda h, w, t: linear_cross_entropy(h, w, t, 1.0, "none")
    try:
        import agilerl

        agilerl.HAS_LLM_DEPENDENCIES = True
        from agilerl.algorithms.core.base import LLMAlgorithm

        from logitless.integrations.agilerl import _logprobs

        rows["agilerl"] = lambda h, w, t: (
            LLMAlgorithm._logprobs_from_hidden_fused_grad(h[None], w, None, t[None], 1.0, True)[0],
            None,
        )
        rows["logitless-agilerl"] = lambda h, w, t: (_logprobs(h[None], w, None, t[None])[0], None)
    except Exception as e:
        print(f"agilerl rows unavailable: {e!r}")
    try:
        ctx = package_modules("openrlhf.models.utils", stubs=("deepspeed",))
        _OPEN.append(ctx)
        (utils,) = ctx.__enter__()

        def openrlhf(h, w, t):
            logits = (h @ w.T).to(torch.float32)  # Actor.forward: output["logits"].to(torch.float32)
            return utils.log_probs_from_logits(logits, t), utils.compute_entropy(logits)

        rows["openrlhf"] = openrlhf
    except Exception as e:
        print(f"openrlhf row unavailable: {e!r}")

    def logitless_row(h, w, t):
        st = vocab_stats(h, Head(w), t, entropy=True)
        return st.logp, st.entropy

    rows["logitless"] = logitless_row
    return rows


def _one(shape: str, dtype: torch.dtype, rows: dict[str, Fn], dev: torch.device) -> None:
    x = make_inputs(parse_shape(shape), dev, dtype)
    h0, w0, t = x.hidden.detach().flatten(0, 1), x.weight.detach(), x.targets.flatten()
    gen = torch.Generator(device=dev).manual_seed(1)  # the weights of logp and entropy in the loss
    a = torch.randn(t.shape, generator=gen, device=dev, dtype=torch.float64)
    b = torch.randn(t.shape, generator=gen, device=dev, dtype=torch.float64)
    ref = _reference(h0, w0, t, a, b, chunk=1024)
    ref_logp = _reference(h0, w0, t, a, torch.zeros_like(b), chunk=1024)  # rows without entropy
    print(f"\n{shape} {dtype}: N={h0.shape[0]} H={h0.shape[1]} V={w0.shape[0]}")
    print(f"{'row':<18} {'ms':>8} {'peak MiB':>9}  rel err vs float64: logp, entropy, d hidden, d weight")
    for name, fn in rows.items():
        try:
            errs, timing, peak = _measure(fn, (h0, w0, t, a, b), ref, ref_logp, dev)
        except Exception as e:
            print(f"{name:<18} {'OOM' if is_oom(e) else 'error'}: {str(e)[:100]}")
            continue
        cells = ", ".join("-" if e is None else f"{e:.1e}" for e in errs)
        mib = "-" if peak is None else f"{peak / 2**20:.0f}"
        print(f"{name:<18} {timing.median_ms:8.1f} {mib:>9}  {cells}")


def _measure(fn: Fn, inputs: tuple, ref: tuple, ref_logp: tuple, dev: torch.device):
    """Errors against float64 (``ref``, or ``ref_logp`` for a row without entropy), timing, peak."""
    h0, w0, t, a, b = inputs
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()

    def reset():
        h.grad = w.grad = None

    def step():
        logp, ent = fn(h, w, t)
        loss = (a.to(logp.dtype) * logp).sum()
        if ent is not None:
            loss = loss + (b.to(ent.dtype) * ent).sum()
        loss.backward()
        return logp, ent

    reset()
    logp, ent = step()
    r = ref if ent is not None else ref_logp
    errs = [rel_diff(logp.double(), r[0]), None if ent is None else rel_diff(ent.double(), r[1])]
    errs += [rel_diff(h.grad.double(), r[2]), rel_diff(w.grad.double(), r[3])]
    del logp, ent
    return errs, time_step(step, reset, dev), peak_bytes(step, reset, dev)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="+")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script on tiny shapes")
    args = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    rows = _rows()
    for shape in args.shapes:
        _one(shape, dtype, rows, torch.device(args.device))
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
