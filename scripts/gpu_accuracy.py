"""Accuracy of each backend against float64 at a bench shape (GPU; run from the repository root).

    python3 scripts/gpu_accuracy.py [shape] [out.json]     # shape: a bench shape, default 8k:llama3-8b

The bench's realistic bf16 inputs (mean entropy 2 nats); the reference is the torch backend on
the same values upcast to float64. For each backend, logits precision and pass mode: the rollout log-probs'
and entropies' max / mean absolute error (nats), and for the bench's GRPO objective (dapo,
beta 0.04) the loss's relative error and the gradients' relative L2 error. Then every cross-entropy
row of the bench (logitless and the other libraries: Liger's Triton and CuTe DSL kernels, Cut
Cross-Entropy, ``torch.compile``), as the bench runs it: the loss's and the gradients' relative errors.
Then the bench's fused DPO, KTO and SimPO on each GPU backend, the same errors; then the bench's
distillation (its teacher head; forward KL and the generalized JSD at beta 0.5) on each GPU
backend with distillation kernels, and the bench's GRPO batches with 25% and 50% of the groups
reward-constant (rows without a gradient left out), against the same bf16 inputs upcast to float64.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch

import logitless
from logitless import PassOptions
from logitless.bench.batches import group_inputs
from logitless.bench.cases import make_inputs, parse_shape
from logitless.bench.competitors import Unavailable, _teacher, dpo_logitless, kto_logitless, rows_of, simpo_logitless
from logitless.bench.plain import GRPO_CONFIG
from logitless.ops.contract import cute_runs_on

# (backend, logits precision, mode): recompute mode on the gemm backend writes dy from the GEMM epilogue.
ROWS = [("triton", "fp32", "fused"), ("gemm", "fp32", "fused"), ("gemm", "fp32", "recompute"),
        ("triton", "input", "fused")]
if torch.cuda.is_available() and cute_runs_on(torch.device("cuda")):
    ROWS += [("cute", "fp32", "fused"), ("cute", "fp32", "recompute")]


def _run(x, hidden, weight, options):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    lp, ent = logitless.token_logprobs(h.detach(), w.detach(), x.targets, entropy=True, options=options)
    loss, _ = logitless.policy_loss(h, w, x.targets, x.mask, x.advantages, x.old_logp, x.ref_logp,
                                    config=GRPO_CONFIG, options=options)
    loss.backward()
    return lp.double(), ent.double(), loss.detach().double(), h.grad.double(), w.grad.double()


def _errors(got: tuple, ref: tuple) -> dict[str, float]:
    """``(loss, d hidden, d weight)`` against float64's: the loss's absolute and relative errors (a
    loss that nearly cancels, as a policy loss over group-normalized advantages, has a small value:
    its float64 value is given beside them) and the gradients' relative errors."""
    return {"loss": ref[0].item(), "loss_abs": (got[0] - ref[0]).abs().item(),
            "loss_rel": ((got[0] - ref[0]).abs() / ref[0].abs()).item(),
            "grad_hidden_rel": ((got[1] - ref[1]).norm() / ref[1].norm()).item(),
            "grad_weight_rel": ((got[2] - ref[2]).norm() / ref[2].norm()).item()}


def _ce_rows(x) -> list[dict]:
    """Each cross-entropy row of the bench against the float64 token mean."""
    h = x.hidden.detach().double().reshape(-1, x.hidden.shape[-1]).requires_grad_()
    w = x.weight.detach().double().requires_grad_()
    ref, _ = logitless.cross_entropy(h, w, x.targets.reshape(-1), options=PassOptions(impl="torch"))
    ref.backward()
    ref_h, ref_w, ref = h.grad.reshape(x.hidden.shape), w.grad, ref.detach()
    del h, w
    out = []
    for row in rows_of("ce"):
        if row.role == "floor":
            continue
        x.hidden.grad = x.weight.grad = None
        try:
            loss = row.prepare(x, "auto").step()["loss"].double()
        except Unavailable as e:
            out.append({"row": row.name, "skipped": str(e)})
            continue
        out.append({"row": row.name,
                    **_errors((loss, x.hidden.grad.double(), x.weight.grad.double()), (ref, ref_h, ref_w))})
        x.hidden.grad = x.weight.grad = None
        torch.cuda.empty_cache()
    return out


def _fused_against_float64(x, make) -> list[dict]:
    """``make(inputs, impl).step()`` (a bench row's ``prepare``) on each GPU backend, fused with fp32
    logits, against the torch backend on ``x`` upcast to float64: :func:`_errors` per backend."""
    x64 = dataclasses.replace(x, hidden=x.hidden.detach().double().requires_grad_(),
                              weight=x.weight.detach().double().requires_grad_())
    ref = make(x64, "torch").step()["loss"].double()
    ref_h, ref_w = x64.hidden.grad, x64.weight.grad
    del x64
    out = []
    for impl in [r[0] for r in ROWS if r[1:] == ("fp32", "fused")]:
        x.hidden.grad = x.weight.grad = None
        loss = make(x, impl).step()["loss"].double()
        out.append({"impl": impl,
                    **_errors((loss, x.hidden.grad.double(), x.weight.grad.double()), (ref, ref_h, ref_w))})
    x.hidden.grad = x.weight.grad = None
    del ref_h, ref_w
    torch.cuda.empty_cache()
    return out


def _preference_rows(x) -> list[dict]:
    """The bench's fused DPO, KTO and SimPO on each GPU backend against the torch backend in float64."""
    return [{"objective": name, **r}
            for name, make in (("dpo", dpo_logitless), ("kto", kto_logitless), ("simpo", simpo_logitless))
            for r in _fused_against_float64(x, make)]


def _skipping_rows(x) -> list[dict]:
    """The bench's GRPO batches with reward-constant groups (``beta`` 0: their rows have no gradient,
    and the pass leaves them out; its rows with a gradient first, its first chunk started after
    the count's read) on each GPU backend, fused, against the torch backend in float64."""
    out = []
    for objective in ("grpo-c25", "grpo-c50"):
        (row,) = [r for r in rows_of(objective) if r.name == "logitless-fused"]
        out += [{"objective": objective, **r} for r in _fused_against_float64(group_inputs(x, objective), row.prepare)]
    return out


def _distill_rows(x) -> list[dict]:
    """The bench's distillation on each GPU backend against the torch backend in float64."""
    th, tw = _teacher(x)
    h, w = x.hidden.detach().reshape(-1, x.hidden.shape[-1]), x.weight.detach()
    out = []
    for divergence, beta in (("forward_kl", 0.0), ("generalized_jsd", 0.5)):
        cfg = logitless.DistillConfig(divergence=divergence, beta=beta)

        def run(hh, ww, t_h, t_w, impl, cfg=cfg):
            hh, ww = hh.clone().requires_grad_(), ww.clone().requires_grad_()
            loss, _ = logitless.distill_loss(hh, ww, t_h, t_w, config=cfg, options=PassOptions(impl=impl))
            loss.backward()
            return loss.detach().double(), hh.grad.double(), ww.grad.double()

        ref = run(h.double(), w.double(), th.double(), tw.double(), "torch")
        for impl in sorted({r[0] for r in ROWS} - {"triton"}):  # the backends with distillation kernels
            got = run(h, w, th, tw, impl)
            out.append({"objective": divergence, "impl": impl, **_errors(got, ref)})
            del got
        del ref
        torch.cuda.empty_cache()
    return out


def main() -> None:
    case = parse_shape(sys.argv[1] if len(sys.argv) > 1 else "8k:llama3-8b")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: TRITON_INTERPRET=1
    x = make_inputs(case, device, torch.bfloat16, target_entropy=2.0)
    ref = _run(x, x.hidden.double(), x.weight.double(), PassOptions(impl="torch"))
    rows = []
    for impl, precision, mode in ROWS:
        got = _run(x, x.hidden, x.weight, PassOptions(impl=impl, logits_precision=precision, mode=mode))
        lp_err, ent_err = ((got[i] - ref[i]).abs() for i in (0, 1))
        rows.append({"impl": impl, "logits_precision": precision, "mode": mode,
                     "logp_max_abs": lp_err.max().item(), "logp_mean_abs": lp_err.mean().item(),
                     "entropy_max_abs": ent_err.max().item(),
                     "loss_rel": ((got[2] - ref[2]).abs() / ref[2].abs()).item(),
                     "grad_hidden_rel": ((got[3] - ref[3]).norm() / ref[3].norm()).item(),
                     "grad_weight_rel": ((got[4] - ref[4]).norm() / ref[4].norm()).item()})
        del got
        torch.cuda.empty_cache()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    record = {"device": name, "shape": case.label, "true_entropy": x.true_entropy,
              "rows": rows, "ce_rows": _ce_rows(x), "preference_rows": _preference_rows(x),
              "skipping_rows": _skipping_rows(x), "distill_rows": _distill_rows(x)}
    print(f"{record['device']}  {case.label}  mean entropy {x.true_entropy:.2f} nats; errors vs float64")
    print(f"{'backend':8s} {'logits':6s} {'mode':9s} {'logp max':>9s} {'logp mean':>9s} {'ent max':>9s} "
          f"{'loss rel':>9s} {'dh rel':>9s} {'dW rel':>9s}")
    for r in rows:
        print(f"{r['impl']:8s} {r['logits_precision']:6s} {r['mode']:9s} {r['logp_max_abs']:9.2e} "
              f"{r['logp_mean_abs']:9.2e} {r['entropy_max_abs']:9.2e} {r['loss_rel']:9.2e} {r['grad_hidden_rel']:9.2e} "
              f"{r['grad_weight_rel']:9.2e}")
    print(f"cross-entropy rows as the bench runs them: {'row':22s} {'loss rel':>9s} {'dh rel':>9s} {'dW rel':>9s}")
    for r in record["ce_rows"]:
        print(f"  {r['row']:22s} " + (f"{r['loss_rel']:9.2e} {r['grad_hidden_rel']:9.2e} {r['grad_weight_rel']:9.2e}"
                                      if "loss_rel" in r else f"skipped: {r['skipped']}"))
    print(f"fused preference losses: {'objective':9s} {'backend':8s} {'loss rel':>9s} {'dh rel':>9s} {'dW rel':>9s}")
    for r in record["preference_rows"]:
        print(f"  {r['objective']:9s} {r['impl']:8s} {r['loss_rel']:9.2e} {r['grad_hidden_rel']:9.2e} "
              f"{r['grad_weight_rel']:9.2e}")
    print(f"GRPO, reward-constant groups: {'objective':9s} {'backend':8s} {'loss':>9s} {'loss abs':>9s} "
          f"{'loss rel':>9s} {'dh rel':>9s} {'dW rel':>9s}")
    for r in record["skipping_rows"]:
        print(f"  {r['objective']:9s} {r['impl']:8s} {r['loss']:9.2e} {r['loss_abs']:9.2e} {r['loss_rel']:9.2e} "
              f"{r['grad_hidden_rel']:9.2e} {r['grad_weight_rel']:9.2e}")
    print(f"distillation: {'objective':15s} {'backend':8s} {'loss rel':>9s} {'dh rel':>9s} {'dW rel':>9s}")
    for r in record["distill_rows"]:
        print(f"  {r['objective']:15s} {r['impl']:8s} {r['loss_rel']:9.2e} {r['grad_hidden_rel']:9.2e} "
              f"{r['grad_weight_rel']:9.2e}")
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
