"""The rows of the benchmark: one function per implementation and objective.

Each row function takes a case's :class:`~logitless.bench.cases.Inputs` and the logitless
backend name, and returns a :class:`Prepared` whose ``step()`` runs the whole measured work
once (forward, and backward into ``hidden.grad`` / ``weight.grad`` for training objectives)
and returns named outputs for the agreement check. A row that cannot run here (library not
installed, needs CUDA) raises :class:`Unavailable` with the reason, and is recorded as skipped.

Objectives:

* ``grpo``: TRL's GRPO loss (``loss_type="dapo"``, ``beta=0.04`` k3 KL to ``ref_logp`` with the
  bias correction, clip and KL metrics, entropy metric), forward + backward.
* ``ce``: SFT / token-mean cross-entropy, forward + backward.
* ``rollout``: no-grad target log-probs + entropy (old-policy / reference passes).
* ``distill``: forward KL(teacher‖student), token mean, forward + backward.
* ``jsd``: the generalized JSD with ``beta = 0.5`` (GKD's default; TRL's
  ``GKDTrainer.generalized_jsd_loss``), token mean, forward + backward.
* ``dpo``: DPO (``sigmoid``, ``beta=0.1``, mean over pairs) with precomputed reference
  log-probs: per-sequence log-prob sums of the chosen (first half of the batch rows) and
  rejected (second half) completions + the loss, forward + backward; logitless fused
  (``dpo_loss_fused``, the reference row) and recompute (``sequence_logps`` + ``dpo_loss``).
* ``kto``: KTO (``loss_type="kto"``, ``beta=0.1``, mean over sequences) with precomputed
  reference log-probs and KL estimate, every other sequence desirable: per-sequence log-prob sums
  + the loss, forward + backward; logitless fused (``kto_loss_fused``) and recompute.
* ``simpo``: SimPO (``beta=2``, ``gamma=0.5``, per-token mean log-probs, no reference, no NLL
  term), chosen = first half of the batch rows; logitless fused (``simpo_loss_fused``) and
  recompute (``sequence_logps`` + ``simpo_loss``).
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch

import logitless

from ..objectives import PolicyConfig
from ..ops import PassOptions, resolve_backend
from .batches import GROUP_OBJECTIVES, group_config, is_group_objective
from .cases import Inputs
from .plain import (
    DPO_BETA,
    GRPO_CONFIG,
    KTO_BETA,
    SIMPO_BETA,
    SIMPO_GAMMA,
    dpo_sigmoid_loss,
    grpo_args,
    grpo_from_logp,
    kto_loss_from_logps,
    plain_ce,
    plain_dpo,
    plain_grpo,
    plain_kto,
    plain_logp_entropy,
    plain_simpo,
    simpo_loss_from_logps,
)

Objective = Literal["grpo", "ce", "rollout", "distill", "jsd", "dpo", "kto", "simpo"]
OBJECTIVES: tuple[Objective, ...] = ("grpo", "ce", "rollout", "distill", "jsd", "dpo", "kto", "simpo")
JSD_BETA = 0.5  # the jsd objective's mixture weight
Outputs = dict[str, torch.Tensor]

# Workspace of the floor's logits buffer: token chunks of the three GEMMs stay this small.
FLOOR_BUFFER_BYTES = 4 * 2**30


class Unavailable(Exception):
    """The row cannot run in this environment; the message says why."""


@dataclass
class Prepared:
    """A row ready to run on one case.

    Attributes:
        step: runs the measured work once; returns outputs to check (``loss``, ``entropy`` mean,
            or per-token ``logp``/``entropy`` for rollouts; empty for the floor).
        impl: the backend that ran (logitless rows), else ``None``.
    """

    step: Callable[[], Outputs]
    impl: str | None = None


@dataclass(frozen=True)
class Row:
    """One implementation of one objective.

    Attributes:
        name: row name in the tables (``logitless-fused``, ``trl-chunked``, ``floor`` ...).
        objective: one of :data:`OBJECTIVES`.
        prepare: ``(inputs, impl) -> Prepared``; raises :class:`Unavailable`.
        logit_bytes: bytes per ``(token, vocab)`` element a materializing row holds at its
            peak (0 for rows that never materialize the logits); predicts OOM before trying.
        role: ``"reference"`` (the logitless row others are checked against), ``"floor"`` or ``""``.
    """

    name: str
    objective: Objective
    prepare: Callable[[Inputs, str], Prepared]
    logit_bytes: float = 0.0
    role: str = ""

    @property
    def summary(self) -> str:
        fn = self.prepare.func if isinstance(self.prepare, partial) else self.prepare
        return (inspect.getdoc(fn) or "").split("\n\n")[0].replace("\n", " ")


def _train_outputs(loss: torch.Tensor, metrics: dict[str, torch.Tensor] | None = None) -> Outputs:
    loss.backward()
    out = {"loss": loss.detach()}
    if metrics and "entropy" in metrics:
        out["entropy"] = metrics["entropy"].detach()
    return out


def _impl_name(impl: str, device: torch.device) -> str:
    return resolve_backend(impl, torch.empty(0, device=device, dtype=torch.bfloat16)).NAME


def _need_cuda(x: Inputs, what: str) -> None:
    if x.hidden.device.type != "cuda":
        raise Unavailable(f"{what} needs CUDA")


def _import(module: str, package: str):
    try:
        return importlib.import_module(module)
    except Exception as e:  # ImportError, or a broken optional dependency underneath
        raise Unavailable(f"{package} not importable: {type(e).__name__}: {e}") from None


# ---------------------------------------------------------------- GRPO


def _options(mode: str, impl: str, fp32_logits: bool, skip_zero_rows: bool = True,
             chunk_bytes: int | None = None) -> PassOptions:
    return PassOptions(mode=mode, impl=impl, logits_precision="fp32" if fp32_logits else "input",
                       skip_zero_rows=skip_zero_rows, chunk_bytes=chunk_bytes)


def _one_chunk(x: Inputs) -> int:
    """A ``chunk_bytes`` that holds every row's 16-bit logits, so a pass runs as one chunk where
    its kept tile is 16-bit (the gemm and CuTe backends): ``N V 2`` bytes."""
    return x.hidden.shape[0] * x.hidden.shape[1] * x.weight.shape[0] * 2


def grpo_logitless(x: Inputs, impl: str, mode: str, fp32_logits: bool = True, cfg: PolicyConfig = GRPO_CONFIG,
                   skip_zero_rows: bool = True, frozen_head: bool = False, one_chunk: bool = False) -> Prepared:
    """logitless ``policy_loss`` (dapo, beta, all metrics, entropy) in one vocabulary pass;
    ``fused``: gradients computed inside the forward (3 GEMMs), ``recompute``: logits
    recomputed in the backward (4 GEMMs), O(N) saved state. ``fp32_logits=False``: the GEMM's
    output rounded to bf16 as the plain path's (statistics still fp32). Rows whose gradient is
    known to be exactly zero (``beta = 0``: the tokens of zero advantage) are left out of the
    gradient GEMMs unless ``skip_zero_rows=False``. ``frozen_head``: no ``d weight`` (a head that
    is not trained, e.g. tied or LoRA elsewhere): 2 GEMMs of work. ``one_chunk``: a
    ``chunk_bytes`` of every row's 16-bit logits (one chunk, no ``d weight`` accumulator, more
    memory where the default 1 GiB budget splits the rows)."""
    options = _options(mode, impl, fp32_logits, skip_zero_rows, _one_chunk(x) if one_chunk else None)
    weight = x.weight.detach() if frozen_head else x.weight

    def step() -> Outputs:
        loss, metrics = logitless.policy_loss(x.hidden, weight, x.targets, x.mask, x.advantages, x.old_logp,
                                              x.ref_logp, config=cfg, options=options)
        return _train_outputs(loss, metrics)

    return Prepared(step, _impl_name(impl, x.hidden.device))


def _trl_function():
    mod = _import("trl.kernels.chunked_logprob", "trl")
    # The backward imports trl.trainer.utils (datasets, accelerate ...): fail here, not mid-backward.
    utils = _import("trl.trainer.utils", "trl (trainer utils)")
    return mod.ChunkedLogProbFunction, getattr(utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", 32768)


def grpo_trl_chunked(x: Inputs, impl: str, cfg: PolicyConfig = GRPO_CONFIG) -> Prepared:
    """TRL's own chunked head (``trl.kernels.ChunkedLogProbFunction``, the trainer's vocabulary
    chunk, log-probs + entropy) followed by TRL's GRPO math on the ``[B, T]`` log-probs."""
    fn, chunk = _trl_function()
    b, t, h = x.hidden.shape

    def step() -> Outputs:
        logp, ent, *_ = fn.apply(x.hidden.reshape(-1, h), x.weight, None, x.targets.reshape(-1), 1.0, chunk, None,
                                 1.0, ("entropy",))
        loss, metrics = grpo_from_logp(logp.view(b, t), ent.detach().view(b, t), x.mask, x.advantages, x.old_logp,
                                       x.ref_logp, cfg)
        return _train_outputs(loss, metrics)

    return Prepared(step)


def grpo_torch_plain(x: Inputs, impl: str, loss_fn: Callable = plain_grpo) -> Prepared:
    """Plain PyTorch: materialized bf16 logits ``[N, V]`` → fp32 ``log_softmax`` → gather →
    TRL's GRPO math (entropy from the same log-softmax)."""

    def step() -> Outputs:
        return _train_outputs(*loss_fn(x.hidden, x.weight, *grpo_args(x)))

    return Prepared(step)


def grpo_liger(x: Inputs, impl: str, cfg: PolicyConfig = GRPO_CONFIG) -> Prepared:
    """Liger-Kernel ``LigerFusedLinearGRPOLoss`` (dapo, beta, bias-corrected KL, default chunk of
    one sequence, its ``torch.compile``'d loss math); it computes no entropy."""
    _need_cuda(x, "Liger-Kernel")
    mod = _import("liger_kernel.chunked_loss", "liger-kernel")
    kwargs = dict(beta=cfg.beta, epsilon_low=cfg.epsilon, epsilon_high=cfg.eps_high, loss_type=cfg.loss_type,
                  use_ref_model=cfg.beta != 0.0)
    params = inspect.signature(mod.LigerFusedLinearGRPOLoss).parameters
    if "use_bias_correction_kl" in params:
        kwargs["use_bias_correction_kl"] = cfg.use_bias_correction_kl
    loss_fn = mod.LigerFusedLinearGRPOLoss(**kwargs)
    n_items = {"num_items_in_batch": x.mask.sum()} if "num_items_in_batch" in inspect.signature(
        loss_fn.forward).parameters else {}

    def step() -> Outputs:
        out = loss_fn(x.hidden, x.weight, x.targets, x.mask, x.advantages, ref_per_token_logps=x.ref_logp,
                      old_per_token_logps=x.old_logp, **n_items)
        loss = out[0] if isinstance(out, tuple) else out
        return _train_outputs(loss)

    return Prepared(step)


# ---------------------------------------------------------------- cross-entropy


def ce_logitless(x: Inputs, impl: str, mode: str, fp32_logits: bool = True, one_chunk: bool = False) -> Prepared:
    """``logitless.cross_entropy`` (token mean) in one vocabulary pass, ``fused`` or ``recompute``;
    ``fp32_logits=False``: logits rounded to bf16 as the plain path's; ``one_chunk``: a
    ``chunk_bytes`` of every row's 16-bit logits (one chunk where the default budget splits them)."""
    h2, y = x.hidden.reshape(-1, x.hidden.shape[-1]), x.targets.reshape(-1)
    options = _options(mode, impl, fp32_logits, chunk_bytes=_one_chunk(x) if one_chunk else None)

    def step() -> Outputs:
        loss, _ = logitless.cross_entropy(h2, x.weight, y, options=options)
        return _train_outputs(loss)

    return Prepared(step, _impl_name(impl, x.hidden.device))


def ce_trl_chunked(x: Inputs, impl: str) -> Prepared:
    """TRL's chunked head (``ChunkedLogProbFunction``, log-probs only) → ``-logp.mean()``, as
    TRL's SFT fused-head loss."""
    fn, chunk = _trl_function()
    h2, y = x.hidden.reshape(-1, x.hidden.shape[-1]), x.targets.reshape(-1)

    def step() -> Outputs:
        logp = fn.apply(h2, x.weight, None, y, 1.0, chunk, None, 1.0, ())[0]
        return _train_outputs(-logp.mean())

    return Prepared(step)


def ce_torch_plain(x: Inputs, impl: str, loss_fn: Callable = plain_ce) -> Prepared:
    """Plain PyTorch: materialized bf16 logits → ``F.cross_entropy`` in fp32."""
    h2, y = x.hidden.reshape(-1, x.hidden.shape[-1]), x.targets.reshape(-1)

    def step() -> Outputs:
        return _train_outputs(loss_fn(h2, x.weight, y))

    return Prepared(step)


def ce_liger(x: Inputs, impl: str) -> Prepared:
    """Liger-Kernel fused linear cross-entropy (``liger_fused_linear_cross_entropy``, mean)."""
    _need_cuda(x, "Liger-Kernel")
    mod = _import("liger_kernel.transformers.functional", "liger-kernel")
    h2, y = x.hidden.reshape(-1, x.hidden.shape[-1]), x.targets.reshape(-1)

    def step() -> Outputs:
        out = mod.liger_fused_linear_cross_entropy(h2, x.weight, y)
        return _train_outputs(out[0] if isinstance(out, tuple) else out)

    return Prepared(step)


def ce_liger_cute(x: Inputs, impl: str) -> Prepared:
    """Liger-Kernel's CuTe DSL fused linear cross-entropy for Hopper
    (``liger_kernel.ops.cutedsl.ops.fused_linear_cross_entropy_sm90``, mean): its logits GEMM
    writes bf16 logits once, a kernel overwrites them with ``d logits``, and two GEMMs follow.
    Needs ``nvidia-cutlass-dsl``, an sm90 GPU, bf16, ``N`` a multiple of 128 and ``V`` of 256."""
    _need_cuda(x, "Liger-Kernel's CuTe DSL path")
    if torch.cuda.get_device_capability(x.hidden.device) != (9, 0):
        raise Unavailable("Liger-Kernel's CuTe DSL fused linear cross-entropy runs on sm90 only")
    n, vocab = x.hidden.shape[0] * x.hidden.shape[1], x.weight.shape[0]
    if x.hidden.dtype != torch.bfloat16 or n % 128 or vocab % 256:
        raise Unavailable(f"Liger-Kernel's CuTe DSL fused linear cross-entropy takes bf16, N a multiple of 128 "
                          f"and V of 256 (got {x.hidden.dtype}, N={n}, V={vocab})")
    mod = _import("liger_kernel.ops.cutedsl.ops.fused_linear_cross_entropy_sm90", "liger-kernel's CuTe DSL ops")
    h2, y = x.hidden.reshape(-1, x.hidden.shape[-1]), x.targets.reshape(-1)

    def step() -> Outputs:
        return _train_outputs(mod.liger_fused_linear_cross_entropy_sm90(h2, x.weight, y))

    return Prepared(step)


def ce_cce(x: Inputs, impl: str) -> Prepared:
    """Apple Cut Cross-Entropy ``linear_cross_entropy`` (``cce`` kernels, default gradient
    filtering), mean."""
    _need_cuda(x, "Cut Cross-Entropy")
    mod = _import("cut_cross_entropy", "cut-cross-entropy")
    h2, y = x.hidden.reshape(-1, x.hidden.shape[-1]), x.targets.reshape(-1)

    def step() -> Outputs:
        return _train_outputs(mod.linear_cross_entropy(h2, x.weight, y))

    return Prepared(step)


# ---------------------------------------------------------------- rollout (no grad)


def rollout_logitless(x: Inputs, impl: str, fp32_logits: bool = True) -> Prepared:
    """logitless ``token_logprobs(..., entropy=True)``: no-grad log-probs + entropy;
    ``fp32_logits=False``: logits rounded to bf16 as the plain path's."""
    h2, y = x.hidden.detach().reshape(-1, x.hidden.shape[-1]), x.targets.reshape(-1)
    w = x.weight.detach()

    def step() -> Outputs:
        logp, ent = logitless.token_logprobs(h2, w, y, entropy=True,
                                             options=_options("auto", impl, fp32_logits))
        return {"logp": logp, "entropy": ent}

    return Prepared(step, _impl_name(impl, x.hidden.device))


def rollout_trl_chunked(x: Inputs, impl: str) -> Prepared:
    """TRL's ``ChunkedLogProbFunction`` forward only (log-probs + entropy), under ``no_grad``."""
    fn, chunk = _trl_function()
    h2, y = x.hidden.detach().reshape(-1, x.hidden.shape[-1]), x.targets.reshape(-1)
    w = x.weight.detach()

    def step() -> Outputs:
        with torch.no_grad():
            logp, ent, *_ = fn.apply(h2, w, None, y, 1.0, chunk, None, 1.0, ("entropy",))
        return {"logp": logp, "entropy": ent}

    return Prepared(step)


def rollout_torch_plain(x: Inputs, impl: str) -> Prepared:
    """Plain PyTorch forward: materialized bf16 logits → fp32 ``log_softmax`` → gather + entropy."""
    h2, y = x.hidden.detach().reshape(-1, x.hidden.shape[-1]), x.targets.reshape(-1)
    w = x.weight.detach()

    def step() -> Outputs:
        with torch.no_grad():
            logp, ent = plain_logp_entropy(h2, w, y)
        return {"logp": logp, "entropy": ent}

    return Prepared(step)


# ---------------------------------------------------------------- floors


def _floor_chunk(x: Inputs) -> int:
    n, v = x.hidden.shape[0] * x.hidden.shape[1], x.weight.shape[0]
    rows = max(1024, FLOOR_BUFFER_BYTES // (v * x.weight.element_size()))
    return min(n, rows)


def floor_three_gemms(x: Inputs, impl: str) -> Prepared:
    """FLOOR: the three bf16 cuBLAS GEMMs of a head's forward + backward alone, nothing else:
    ``logits = h Wᵀ``, ``d hidden = logits W``, ``d weight += logitsᵀ h``, over token chunks
    whose logits buffer stays under 4 GiB (d weight accumulated in place, bf16)."""
    h2 = x.hidden.detach().reshape(-1, x.hidden.shape[-1])
    w = x.weight.detach()
    n, v = h2.shape[0], w.shape[0]
    chunk = _floor_chunk(x)

    def step() -> Outputs:
        buf = torch.empty(chunk, v, dtype=w.dtype, device=w.device)
        grad_h = torch.empty_like(h2)
        grad_w = torch.empty_like(w)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            logits = torch.mm(h2[s:e], w.t(), out=buf[: e - s])
            torch.mm(logits, w, out=grad_h[s:e])
            if s == 0:
                torch.mm(logits.t(), h2[s:e], out=grad_w)
            else:
                grad_w.addmm_(logits.t(), h2[s:e])
        return {}

    return Prepared(step)


def floor_one_gemm(x: Inputs, impl: str) -> Prepared:
    """FLOOR (rollout): the logits GEMM ``h Wᵀ`` alone, in the same token chunks."""
    h2 = x.hidden.detach().reshape(-1, x.hidden.shape[-1])
    w = x.weight.detach()
    n, v = h2.shape[0], w.shape[0]
    chunk = _floor_chunk(x)

    def step() -> Outputs:
        buf = torch.empty(chunk, v, dtype=w.dtype, device=w.device)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            torch.mm(h2[s:e], w.t(), out=buf[: e - s])
        return {}

    return Prepared(step)


# ---------------------------------------------------------------- distillation


def _teacher(x: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """A teacher head close to the student's: same vocabulary, perturbed hidden states and weight
    (so that the forward KL is a realistic ~0.1-1 nats), made once per case outside the timing."""
    g = torch.Generator(device=x.hidden.device).manual_seed(7)
    h = x.hidden.detach()
    w = x.weight.detach()
    th = (h.float() + 0.3 * h.float().std() * torch.randn(h.shape, generator=g, device=h.device)).to(h.dtype)
    tw = (w.float() + 0.3 * w.float().std() * torch.randn(w.shape, generator=g, device=w.device)).to(w.dtype)
    return th.reshape(-1, th.shape[-1]), tw


def distill_logitless(x: Inputs, impl: str, beta: float = 0.0) -> Prepared:
    """logitless ``distill_loss`` (forward KL(teacher‖student), or with ``beta`` > 0 the
    generalized JSD; token mean): both heads in one blocked pass over the vocabulary, neither's
    logits materialized in fp32 (the gemm kernels where ``impl`` resolves to them, else the torch
    functions)."""
    import logitless

    th, tw = _teacher(x)
    cfg = (logitless.DistillConfig(divergence="forward_kl") if beta == 0.0
           else logitless.DistillConfig(divergence="generalized_jsd", beta=beta))
    options = logitless.PassOptions(impl=impl)

    def step() -> Outputs:
        h2 = x.hidden.reshape(-1, x.hidden.shape[-1])
        loss, _ = logitless.distill_loss(h2, x.weight, th, tw, config=cfg, options=options)
        return _train_outputs(loss)

    from ..ops.distill_contract import resolve_distill

    # The backend whose distillation kernels run.
    kernels = resolve_distill(impl, x.hidden.detach(), th, 0)
    return Prepared(step, kernels.__name__.split(".")[-2].removesuffix("_backend"))


def distill_trl_chunked(x: Inputs, impl: str, beta: float = 0.0) -> Prepared:
    """TRL's chunked divergence head (``trl.kernels.chunked_divergence.ChunkedDivergenceFunction``;
    ``beta = 0``: forward KL, in ``(0, 1)``: the generalized JSD), token mean."""
    mod = _import("trl.kernels.chunked_divergence", "trl")
    th, tw = _teacher(x)

    def step() -> Outputs:
        h2 = x.hidden.reshape(-1, x.hidden.shape[-1])
        div, _ent = mod.ChunkedDivergenceFunction.apply(h2, x.weight, None, th, tw, None, beta)
        return _train_outputs(div.mean())

    return Prepared(step)


def plain_distill(h2: torch.Tensor, w: torch.Tensor, th: torch.Tensor, tw: torch.Tensor,
                  beta: float = 0.0) -> torch.Tensor:
    """Both heads' bf16 logits ``[N, V]`` materialized → fp32 log-softmax → forward KL, or
    (``beta`` > 0) ``β KL(q‖m) + (1-β) KL(p‖m)`` with ``m = β q + (1-β) p`` (TRL's
    ``generalized_jsd_loss``); token mean."""
    logp = torch.log_softmax((h2 @ w.t()).float(), -1)
    with torch.no_grad():
        logq = torch.log_softmax((th @ tw.t()).float(), -1)
    if beta == 0.0:
        return (logq.exp() * (logq - logp)).sum(-1).mean()
    logm = torch.logaddexp(logp + math.log1p(-beta), logq + math.log(beta))
    kl_q = (logq.exp() * (logq - logm)).sum(-1)
    kl_p = (logp.exp() * (logp - logm)).sum(-1)
    return (beta * kl_q + (1 - beta) * kl_p).mean()


def distill_torch_plain(x: Inputs, impl: str, loss_fn: Callable = plain_distill) -> Prepared:
    """Plain PyTorch (:func:`plain_distill`)."""
    th, tw = _teacher(x)
    h2 = x.hidden.reshape(-1, x.hidden.shape[-1])

    def step() -> Outputs:
        return _train_outputs(loss_fn(h2, x.weight, th, tw))

    return Prepared(step)


def floor_four_gemms(x: Inputs, impl: str) -> Prepared:
    """FLOOR (distillation): the teacher's logits GEMM plus the student's three (logits, d hidden,
    d weight), bf16 cuBLAS, same token chunks as the three-GEMM floor."""
    th, tw = _teacher(x)
    three = floor_three_gemms(x, impl)
    chunk = _floor_chunk(x)

    def step() -> Outputs:
        buf = torch.empty(chunk, tw.shape[0], dtype=tw.dtype, device=tw.device)
        for s in range(0, th.shape[0], chunk):
            e = min(s + chunk, th.shape[0])
            torch.mm(th[s:e], tw.t(), out=buf[: e - s])
        del buf
        return three.step()

    return Prepared(step)


# ---------------------------------------------------------------- DPO

# What TRL 1.16 DPOTrainer.__init__ asks its fused LM head for (add_fused_lm_head(..., outputs=...)): the
# trainer logs entropy, mean logits and top-1 accuracy, so its head computes them on every step.
_DPO_TRL_OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1")


def _dpo_reference(x: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ref_chosen_logps, ref_rejected_logps)``, ``[B/2]`` each: the reference log-prob sums per
    sequence, computed once outside the timing, as a DPO run with precomputed reference log-probs
    has them (TRL's ``precompute_ref_log_probs``)."""
    n_seq = x.targets.shape[0]
    if n_seq % 2:
        raise ValueError(f"dpo needs an even number of sequences (chosen = first half of the batch rows, rejected "
                         f"= second half), got B={n_seq}; pick N a multiple of 2 * T")
    ref_logps = (x.ref_logp * x.mask).sum(-1)
    return ref_logps.chunk(2, dim=0)


def dpo_logitless(x: Inputs, impl: str, mode: str = "fused", fp32_logits: bool = True) -> Prepared:
    """logitless DPO (sigmoid, beta 0.1, TRL's metrics and entropy) over the whole ``[B, T]``
    batch (chosen + rejected). ``fused``: ``dpo_loss_fused``, one call whose chunks hold whole
    pairs, gradients computed inside the forward (3 GEMMs); ``recompute``: ``sequence_logps``
    then ``dpo_loss`` (the two-call path: the backward recomputes the logits, 4 GEMMs).
    ``fp32_logits=False``: logits rounded to bf16 as the plain path's."""
    ref_chosen_logps, ref_rejected_logps = _dpo_reference(x)
    cfg = logitless.DPOLossConfig(beta=DPO_BETA, loss_type="sigmoid")
    options = _options(mode, impl, fp32_logits)

    def step() -> Outputs:
        if mode == "fused":
            loss, metrics = logitless.dpo_loss_fused(x.hidden, x.weight, x.targets, x.mask, ref_chosen_logps,
                                                     ref_rejected_logps, config=cfg, options=options)
        else:
            policy = logitless.sequence_logps(x.hidden, x.weight, x.targets, x.mask, options=options)
            loss, metrics = logitless.dpo_loss(policy, ref_chosen_logps, ref_rejected_logps, config=cfg)
        return _train_outputs(loss, metrics)

    return Prepared(step, _impl_name(impl, x.hidden.device))


def dpo_trl_chunked(x: Inputs, impl: str) -> Prepared:
    """TRL 1.16 ``DPOTrainer``'s own path: its fused LM head (``add_fused_lm_head`` →
    ``trl.kernels.ChunkedLogProbFunction``, the trainer's vocabulary chunk and outputs: log-probs,
    entropy, mean logit, top-1), masked sum per sequence, then ``DPOTrainer._compute_loss``'s
    sigmoid loss (transcribed in ``plain.dpo_sigmoid_loss``)."""
    fn, chunk = _trl_function()
    ref_chosen_logps, ref_rejected_logps = _dpo_reference(x)
    b, t, h = x.hidden.shape

    def step() -> Outputs:
        per_token_logps, entropy, *_ = fn.apply(x.hidden.reshape(-1, h), x.weight, None, x.targets.reshape(-1), 1.0,
                                                chunk, None, 1.0, _DPO_TRL_OUTPUTS)
        logps = per_token_logps.view(b, t).masked_fill(x.mask == 0, 0.0).sum(dim=1)
        chosen_logps, rejected_logps = logps.chunk(2, dim=0)
        loss = dpo_sigmoid_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
        m = x.mask.to(entropy.dtype)
        return _train_outputs(loss, {"entropy": (entropy.detach().view(b, t) * m).sum() / m.sum()})

    return Prepared(step)


def dpo_torch_plain(x: Inputs, impl: str, loss_fn: Callable = plain_dpo) -> Prepared:
    """Plain PyTorch: materialized bf16 logits ``[N, V]`` → fp32 ``log_softmax`` → gather → masked
    sum per sequence → TRL's sigmoid DPO loss (the per-token math of TRL's
    ``selective_log_softmax`` on fp32 logits, which pre-1.x ``DPOTrainer`` ran on the model's logits)."""
    refs = _dpo_reference(x)

    def step() -> Outputs:
        return _train_outputs(loss_fn(x.hidden, x.weight, x.targets, x.mask, *refs))

    return Prepared(step)


def dpo_liger(x: Inputs, impl: str) -> Prepared:
    """Liger-Kernel ``LigerFusedLinearDPOLoss`` (sigmoid, beta 0.1, summed log-probs:
    ``average_log_prob=False``, default chunk of one pair, its ``torch.compile``'d loss math);
    Liger 0.8.5 takes no precomputed reference log-probs, so it runs reference-free (``0``):
    same head work, different loss and gradients (does not agree by construction).

    Liger's only reference input is a reference model's hidden states and weight, whose head it
    would run itself (a fourth GEMM, not the precomputed setting timed here); with
    ``use_ref_model=False`` it subtracts ``0`` for the reference log-probs. A Liger whose
    ``forward`` takes ``ref_chosen_logps`` / ``ref_rejected_logps`` gets the precomputed ones.
    """
    _need_cuda(x, "Liger-Kernel")
    mod = _import("liger_kernel.chunked_loss", "liger-kernel")
    ref_chosen_logps, ref_rejected_logps = _dpo_reference(x)
    takes_refs = {"ref_chosen_logps", "ref_rejected_logps"} <= set(
        inspect.signature(mod.LigerFusedLinearDPOLoss.forward).parameters)
    loss_fn = mod.LigerFusedLinearDPOLoss(beta=DPO_BETA, loss_type="sigmoid", average_log_prob=False,
                                          use_ref_model=takes_refs)
    refs = dict(ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps) if takes_refs else {}
    target = torch.where(x.mask != 0, x.targets, -100)  # Liger's ignore_index marks the non-completion tokens

    def step() -> Outputs:
        out = loss_fn(x.weight, x.hidden, target, **refs)
        return _train_outputs(out[0] if isinstance(out, tuple) else out)

    return Prepared(step)


# ---------------------------------------------------------------- KTO and SimPO

# What TRL 1.16 KTOTrainer.__init__ asks its fused LM head for (it logs entropy and mean logits).
_KTO_TRL_OUTPUTS = ("log_probs", "entropy", "mean_logits")


@dataclass(frozen=True)
class _KTOBatch:
    """KTO's per-sequence inputs, made once outside the timing: ``label [B]`` (every other
    sequence desirable), the reference sums ``ref_logps [B]`` (precomputed, as TRL's
    ``precompute_ref_log_probs``), and the KL completions' sums ``kl_logps``, ``ref_kl_logps``
    ``[B]`` (the policy's no-grad pass and the reference's on the mismatched pairs, a rollout-like
    pass outside the measured step) with the batch's KL estimate ``kl`` (0-dim, clamped at 0)."""

    label: torch.Tensor
    ref_logps: torch.Tensor
    kl_logps: torch.Tensor
    ref_kl_logps: torch.Tensor
    kl: torch.Tensor


def _kto_batch(x: Inputs) -> _KTOBatch:
    m = x.mask.to(x.ref_logp.dtype)
    ref_logps = (x.ref_logp * m).sum(-1)
    # The KL pairs are the batch's completions under other prompts: the old policy's sums stand in
    # for the policy's no-grad pass, the reference's rolled by one row for a mismatched pairing.
    kl_logps, ref_kl_logps = (x.old_logp * m).sum(-1), ref_logps.roll(1)
    kl = (kl_logps - ref_kl_logps).mean().clamp(min=0)
    label = torch.arange(x.targets.shape[0], device=x.targets.device) % 2 == 0
    return _KTOBatch(label, ref_logps, kl_logps, ref_kl_logps, kl)


def kto_logitless(x: Inputs, impl: str, mode: str = "fused", fp32_logits: bool = True) -> Prepared:
    """logitless KTO (``kto``, beta 0.1, TRL's metrics and entropy) over the ``[B, T]`` batch.
    ``fused``: ``kto_loss_fused``, one call whose chunks hold whole sequences, gradients inside the
    forward (3 GEMMs); ``recompute``: ``sequence_logps`` then ``kto_loss`` (4 GEMMs).
    ``fp32_logits=False``: logits rounded to bf16 as the plain path's."""
    k = _kto_batch(x)
    cfg = logitless.KTOLossConfig(beta=KTO_BETA, loss_type="kto")
    options = _options(mode, impl, fp32_logits)

    def step() -> Outputs:
        if mode == "fused":
            loss, metrics = logitless.kto_loss_fused(x.hidden, x.weight, x.targets, x.mask, k.label, k.ref_logps,
                                                     (k.kl_logps, k.ref_kl_logps), config=cfg, options=options)
        else:
            policy = logitless.sequence_logps(x.hidden, x.weight, x.targets, x.mask, options=options)
            loss, metrics = logitless.kto_loss(policy, k.label, k.ref_logps, k.kl_logps, k.ref_kl_logps, config=cfg)
        return _train_outputs(loss, metrics)

    return Prepared(step, _impl_name(impl, x.hidden.device))


def kto_trl_chunked(x: Inputs, impl: str) -> Prepared:
    """TRL 1.16 ``KTOTrainer``'s own path: its fused LM head (``ChunkedLogProbFunction``, the
    trainer's vocabulary chunk and outputs: log-probs, entropy, mean logit), masked sum per
    sequence, then ``KTOTrainer._compute_loss``'s ``kto`` loss (``plain.kto_loss_from_logps``)."""
    fn, chunk = _trl_function()
    k = _kto_batch(x)
    b, t, h = x.hidden.shape

    def step() -> Outputs:
        per_token_logps, entropy, *_ = fn.apply(x.hidden.reshape(-1, h), x.weight, None, x.targets.reshape(-1), 1.0,
                                                chunk, None, 1.0, _KTO_TRL_OUTPUTS)
        logps = per_token_logps.view(b, t).masked_fill(x.mask == 0, 0.0).sum(dim=1)
        loss = kto_loss_from_logps(logps, k.label, k.ref_logps, k.kl)
        m = x.mask.to(entropy.dtype)
        return _train_outputs(loss, {"entropy": (entropy.detach().view(b, t) * m).sum() / m.sum()})

    return Prepared(step)


def kto_torch_plain(x: Inputs, impl: str, loss_fn: Callable = plain_kto) -> Prepared:
    """Plain PyTorch: materialized bf16 logits ``[N, V]`` → fp32 ``log_softmax`` → gather → masked
    sum per sequence → TRL's ``kto`` loss."""
    k = _kto_batch(x)

    def step() -> Outputs:
        return _train_outputs(loss_fn(x.hidden, x.weight, x.targets, x.mask, k.label, k.ref_logps, k.kl))

    return Prepared(step)


def kto_liger(x: Inputs, impl: str) -> Prepared:
    """Liger-Kernel ``LigerFusedLinearKTOLoss`` (beta 0.1, summed log-probs, default chunk, its
    ``torch.compile``'d loss math, the KL estimate passed where its ``forward`` takes ``kl``).
    Like its DPO loss it takes no precomputed reference log-probs (only a reference model's hidden
    states and weight, whose head it would run itself: a fourth GEMM), so it runs reference-free:
    same head work, different loss and gradients (does not agree by construction)."""
    _need_cuda(x, "Liger-Kernel")
    mod = _import("liger_kernel.chunked_loss", "liger-kernel")
    k = _kto_batch(x)
    init = inspect.signature(mod.LigerFusedLinearKTOLoss).parameters
    loss_fn = mod.LigerFusedLinearKTOLoss(beta=KTO_BETA, use_ref_model=False,
                                          **({"average_log_prob": False} if "average_log_prob" in init else {}))
    extra = {"kl": k.kl} if "kl" in inspect.signature(mod.LigerFusedLinearKTOLoss.forward).parameters else {}
    target = torch.where(x.mask != 0, x.targets, -100)  # Liger's ignore_index marks the non-completion tokens

    def step() -> Outputs:
        out = loss_fn(x.hidden, x.weight, target, preference_labels=k.label, **extra)
        return _train_outputs(out[0] if isinstance(out, tuple) else out)

    return Prepared(step)


def _pairs(x: Inputs, objective: str) -> None:
    if x.targets.shape[0] % 2:
        raise ValueError(f"{objective} needs an even number of sequences (chosen = first half of the batch rows, "
                         f"rejected = second half), got B={x.targets.shape[0]}; pick N a multiple of 2 * T")


def simpo_logitless(x: Inputs, impl: str, mode: str = "fused", fp32_logits: bool = True) -> Prepared:
    """logitless SimPO (beta 2, gamma 0.5, TRL's CPO metrics and entropy) over the ``[B, T]``
    batch (chosen + rejected). ``fused``: ``simpo_loss_fused``, chunks of whole pairs, 3 GEMMs;
    ``recompute``: ``sequence_logps`` then ``simpo_loss`` (4 GEMMs). ``fp32_logits=False``:
    logits rounded to bf16 as the plain path's."""
    _pairs(x, "simpo")
    options = _options(mode, impl, fp32_logits)

    def step() -> Outputs:
        if mode == "fused":
            loss, metrics = logitless.simpo_loss_fused(x.hidden, x.weight, x.targets, x.mask, beta=SIMPO_BETA,
                                                       simpo_gamma=SIMPO_GAMMA, options=options)
        else:
            policy = logitless.sequence_logps(x.hidden, x.weight, x.targets, x.mask, options=options)
            loss, metrics = logitless.simpo_loss(policy, beta=SIMPO_BETA, simpo_gamma=SIMPO_GAMMA)
        return _train_outputs(loss, metrics)

    return Prepared(step, _impl_name(impl, x.hidden.device))


def simpo_trl_chunked(x: Inputs, impl: str) -> Prepared:
    """TRL 1.16's chunked LM head (``ChunkedLogProbFunction``, log-probs + entropy, the head its
    DPO and KTO trainers run) → masked mean per sequence → ``CPOTrainer.cpo_loss``'s ``simpo``
    loss. TRL's own ``CPOTrainer`` (``trl.experimental``) materializes the logits instead, as the
    ``torch-plain`` row does."""
    _pairs(x, "simpo")
    fn, chunk = _trl_function()
    b, t, h = x.hidden.shape

    def step() -> Outputs:
        per_token_logps, entropy, *_ = fn.apply(x.hidden.reshape(-1, h), x.weight, None, x.targets.reshape(-1), 1.0,
                                                chunk, None, 1.0, ("log_probs", "entropy"))
        m = x.mask.to(per_token_logps.dtype)
        logps = (per_token_logps.view(b, t) * m).sum(dim=1) / m.sum(dim=1)
        loss = simpo_loss_from_logps(*logps.chunk(2, dim=0))
        return _train_outputs(loss, {"entropy": (entropy.detach().view(b, t) * m).sum() / m.sum()})

    return Prepared(step)


def simpo_torch_plain(x: Inputs, impl: str, loss_fn: Callable = plain_simpo) -> Prepared:
    """Plain PyTorch (what TRL's ``CPOTrainer`` does): materialized bf16 logits ``[N, V]`` → fp32
    ``log_softmax`` → gather → masked mean per sequence → SimPO's loss."""
    _pairs(x, "simpo")

    def step() -> Outputs:
        return _train_outputs(loss_fn(x.hidden, x.weight, x.targets, x.mask))

    return Prepared(step)


def simpo_liger(x: Inputs, impl: str) -> Prepared:
    """Liger-Kernel ``LigerFusedLinearSimPOLoss`` (beta 2, gamma 0.5, no NLL term, its default
    chunk and per-token mean log-probs, its ``torch.compile``'d loss math): the same loss."""
    _need_cuda(x, "Liger-Kernel")
    _pairs(x, "simpo")
    mod = _import("liger_kernel.chunked_loss", "liger-kernel")
    loss_fn = mod.LigerFusedLinearSimPOLoss(beta=SIMPO_BETA, gamma=SIMPO_GAMMA, compute_nll_loss=False)
    target = torch.where(x.mask != 0, x.targets, -100)

    def step() -> Outputs:
        out = loss_fn(x.weight, x.hidden, target)
        return _train_outputs(out[0] if isinstance(out, tuple) else out)

    return Prepared(step)


# Peak bytes per (token, vocab) element of the materializing rows, as measured on an H200 (torch 2.11)
# plus 10%: predicts OOM before trying (a wrong guess only costs the try, which is caught).
def _compiled(plain_row: Callable[..., Prepared], loss_fn: Callable) -> Callable[..., Prepared]:
    """The ``torch.compile`` row of ``plain_row``: the same step with ``loss_fn`` (its fixed
    keyword arguments, e.g. ``cfg``, bound before compiling) compiled by Inductor, default mode;
    compile time is excluded (the timer's warm-up calls compile it). CUDA only."""
    def prepare(x: Inputs, impl: str, **fixed) -> Prepared:
        if x.hidden.device.type != "cuda":
            raise Unavailable("torch.compile row runs on CUDA only (CPU Inductor builds take minutes)")
        return plain_row(x, impl, loss_fn=torch.compile(partial(loss_fn, **fixed), dynamic=False))
    # The row's summary in the reports (Row.summary) is its prepare function's docstring.
    prepare.__doc__ = ("``torch.compile`` (Inductor, default mode; compile time excluded) of the torch-plain row: "
                       + (inspect.getdoc(plain_row) or ""))
    return prepare


grpo_torch_compile = _compiled(grpo_torch_plain, plain_grpo)
ce_torch_compile = _compiled(ce_torch_plain, plain_ce)
distill_torch_compile = _compiled(distill_torch_plain, plain_distill)
dpo_torch_compile = _compiled(dpo_torch_plain, plain_dpo)
kto_torch_compile = _compiled(kto_torch_plain, plain_kto)
simpo_torch_compile = _compiled(simpo_torch_plain, plain_simpo)


_BYTES = {"grpo-plain": 15.0, "ce-plain": 13.0, "rollout-plain": 15.0, "grpo-compile": 6.5, "ce-compile": 2.5,
          "distill-plain": 26.0,
          # Not measured: compiled, the two heads' fp32 logits fuse away as CE's do; twice CE's.
          "distill-compile": 5.0, "jsd-compile": 5.0,
          # Not measured: the plain JSD holds the forward KL's tensors plus the mixture's fp32 log and
          # its two products; estimated from distill-plain.
          "jsd-plain": 38.0,
          # Not measured: the DPO plain path holds the same [N, V] tensors as the CE one (bf16 logits, their fp32
          # copy, the fp32 log_softmax saved for backward, its fp32 gradient, the bf16 logits gradient), and no
          # entropy (GRPO's 15.0 has an exp(log_softmax) more); compiled, as CE's.
          "dpo-plain": 13.0, "dpo-compile": 2.5,
          # Not measured: KTO's and SimPO's plain paths hold DPO's [N, V] tensors.
          "kto-plain": 13.0, "kto-compile": 2.5, "simpo-plain": 13.0, "simpo-compile": 2.5}


def _on_flash(prepare: Callable[[Inputs, str], Prepared]) -> Callable[[Inputs, str], Prepared]:
    """The same logitless row on the flash backend (Triton tile-GEMM kernels, logits never in
    memory); needs CUDA."""
    def run(x: Inputs, impl: str) -> Prepared:
        _need_cuda(x, "the flash backend")
        return prepare(x, "flash")
    return run


def _on_cute(prepare: Callable[[Inputs, str], Prepared]) -> Callable[[Inputs, str], Prepared]:
    """The same logitless row on the CuTe DSL backend (its statistics GEMM in CUTLASS's CuTe DSL);
    needs a Hopper GPU and ``logitless[cute]``."""
    def run(x: Inputs, impl: str) -> Prepared:
        from ..ops.contract import resolve_backend

        _need_cuda(x, "the cute backend")
        try:
            resolve_backend("cute", x.hidden)
        except ValueError as e:
            raise Unavailable(str(e)) from None
        return prepare(x, "cute")
    return run


ROWS: tuple[Row, ...] = (
    Row("floor", "grpo", floor_three_gemms, role="floor"),
    Row("logitless-fused", "grpo", partial(grpo_logitless, mode="fused"), role="reference"),
    Row("logitless-recompute", "grpo", partial(grpo_logitless, mode="recompute")),
    Row("logitless-fused-bf16", "grpo", partial(grpo_logitless, mode="fused", fp32_logits=False)),
    Row("logitless-flash", "grpo", _on_flash(partial(grpo_logitless, mode="recompute"))),
    Row("logitless-cute", "grpo", _on_cute(partial(grpo_logitless, mode="fused"))),
    Row("logitless-one-chunk", "grpo", partial(grpo_logitless, mode="fused", one_chunk=True)),
    Row("trl-chunked", "grpo", grpo_trl_chunked),
    Row("liger", "grpo", grpo_liger),
    Row("torch-plain", "grpo", grpo_torch_plain, logit_bytes=_BYTES["grpo-plain"]),
    Row("torch-compile", "grpo", grpo_torch_compile, logit_bytes=_BYTES["grpo-compile"]),
    Row("floor", "ce", floor_three_gemms, role="floor"),
    Row("logitless-fused", "ce", partial(ce_logitless, mode="fused"), role="reference"),
    Row("logitless-recompute", "ce", partial(ce_logitless, mode="recompute")),
    Row("logitless-fused-bf16", "ce", partial(ce_logitless, mode="fused", fp32_logits=False)),
    Row("logitless-cute", "ce", _on_cute(partial(ce_logitless, mode="fused"))),
    Row("logitless-one-chunk", "ce", partial(ce_logitless, mode="fused", one_chunk=True)),
    Row("trl-chunked", "ce", ce_trl_chunked),
    Row("liger", "ce", ce_liger),
    Row("liger-cute", "ce", ce_liger_cute),
    Row("cce", "ce", ce_cce),
    Row("torch-plain", "ce", ce_torch_plain, logit_bytes=_BYTES["ce-plain"]),
    Row("torch-compile", "ce", ce_torch_compile, logit_bytes=_BYTES["ce-compile"]),
    Row("floor", "rollout", floor_one_gemm, role="floor"),
    Row("logitless", "rollout", rollout_logitless, role="reference"),
    Row("logitless-bf16", "rollout", partial(rollout_logitless, fp32_logits=False)),
    Row("logitless-flash", "rollout", _on_flash(rollout_logitless)),
    Row("logitless-cute", "rollout", _on_cute(rollout_logitless)),
    Row("trl-chunked", "rollout", rollout_trl_chunked),
    Row("torch-plain", "rollout", rollout_torch_plain, logit_bytes=_BYTES["rollout-plain"]),
    Row("floor", "distill", floor_four_gemms, role="floor"),
    Row("logitless", "distill", distill_logitless, role="reference"),
    Row("trl-chunked", "distill", distill_trl_chunked),
    Row("torch-plain", "distill", distill_torch_plain, logit_bytes=_BYTES["distill-plain"]),
    Row("torch-compile", "distill", distill_torch_compile, logit_bytes=_BYTES["distill-compile"]),
    Row("floor", "jsd", floor_four_gemms, role="floor"),
    Row("logitless", "jsd", partial(distill_logitless, beta=JSD_BETA), role="reference"),
    Row("trl-chunked", "jsd", partial(distill_trl_chunked, beta=JSD_BETA)),
    Row("torch-plain", "jsd", partial(distill_torch_plain, loss_fn=partial(plain_distill, beta=JSD_BETA)),
        logit_bytes=_BYTES["jsd-plain"]),
    Row("torch-compile", "jsd", partial(distill_torch_compile, beta=JSD_BETA), logit_bytes=_BYTES["jsd-compile"]),
    Row("floor", "dpo", floor_three_gemms, role="floor"),
    Row("logitless-fused", "dpo", partial(dpo_logitless, mode="fused"), role="reference"),
    Row("logitless-recompute", "dpo", partial(dpo_logitless, mode="recompute")),
    Row("logitless-fused-bf16", "dpo", partial(dpo_logitless, mode="fused", fp32_logits=False)),
    Row("trl-chunked", "dpo", dpo_trl_chunked),
    Row("liger", "dpo", dpo_liger),
    Row("torch-plain", "dpo", dpo_torch_plain, logit_bytes=_BYTES["dpo-plain"]),
    Row("torch-compile", "dpo", dpo_torch_compile, logit_bytes=_BYTES["dpo-compile"]),
    Row("floor", "kto", floor_three_gemms, role="floor"),
    Row("logitless-fused", "kto", partial(kto_logitless, mode="fused"), role="reference"),
    Row("logitless-recompute", "kto", partial(kto_logitless, mode="recompute")),
    Row("logitless-fused-bf16", "kto", partial(kto_logitless, mode="fused", fp32_logits=False)),
    Row("trl-chunked", "kto", kto_trl_chunked),
    Row("liger", "kto", kto_liger),
    Row("torch-plain", "kto", kto_torch_plain, logit_bytes=_BYTES["kto-plain"]),
    Row("torch-compile", "kto", kto_torch_compile, logit_bytes=_BYTES["kto-compile"]),
    Row("floor", "simpo", floor_three_gemms, role="floor"),
    Row("logitless-fused", "simpo", partial(simpo_logitless, mode="fused"), role="reference"),
    Row("logitless-recompute", "simpo", partial(simpo_logitless, mode="recompute")),
    Row("logitless-fused-bf16", "simpo", partial(simpo_logitless, mode="fused", fp32_logits=False)),
    Row("trl-chunked", "simpo", simpo_trl_chunked),
    Row("liger", "simpo", simpo_liger),
    Row("torch-plain", "simpo", simpo_torch_plain, logit_bytes=_BYTES["simpo-plain"]),
    Row("torch-compile", "simpo", simpo_torch_compile, logit_bytes=_BYTES["simpo-compile"]),
)

def _group_rows(objective: str) -> tuple[Row, ...]:
    """The rows of a GRPO batch with group-reward advantages (:mod:`.batches`)."""
    cfg = group_config(objective)
    return (
        Row("floor", objective, floor_three_gemms, role="floor"),
        Row("logitless-fused", objective, partial(grpo_logitless, mode="fused", cfg=cfg), role="reference"),
        Row("logitless-dense", objective, partial(grpo_logitless, mode="fused", cfg=cfg, skip_zero_rows=False)),
        Row("logitless-recompute", objective, partial(grpo_logitless, mode="recompute", cfg=cfg)),
        Row("logitless-frozen-head", objective, partial(grpo_logitless, mode="fused", cfg=cfg, frozen_head=True)),
        Row("trl-chunked", objective, partial(grpo_trl_chunked, cfg=cfg)),
        Row("liger", objective, partial(grpo_liger, cfg=cfg)),
        Row("torch-compile", objective, partial(grpo_torch_compile, cfg=cfg), logit_bytes=_BYTES["grpo-compile"]),
    )


def rows_of(objective: str) -> tuple[Row, ...]:
    """Every row of ``objective`` (one of :data:`OBJECTIVES` or a group objective ``grpo-c<percent>[-kl]``)."""
    if is_group_objective(objective):
        return _group_rows(objective)
    return tuple(r for r in ROWS if r.objective == objective)


ROW_NAMES = tuple(dict.fromkeys(r.name for r in (*ROWS, *_group_rows(GROUP_OBJECTIVES[0]))))
