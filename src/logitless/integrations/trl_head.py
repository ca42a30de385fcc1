"""logitless behind TRL 1.16's fused LM head, shared by the SFT / DPO / KTO / RLOO drop-ins.

TRL 1.16's trainers other than GRPO get every log-prob they use from one call,
``model(**inputs, labels=labels, fused_lm_head=True)`` (``trl.trainer.utils.add_fused_lm_head``),
which returns a ``FusedCausalLMOutput`` of per-token ``log_probs`` / ``entropy`` / ``mean_logits``
/ ``is_top1`` computed by TRL's chunked head. :func:`attach` puts logitless behind that call:
the backbone's final hidden states and the model's head (found by
:func:`~logitless.model_heads.find_head`) go through :func:`logitless.vocab_stats` (one
blocked vocabulary pass, fp32 statistics, no logits), and the trainer's own loss code runs on
the result unchanged — so every loss type, reference model, precomputed reference log-prob and
metric of the trainer is TRL's own code. A call logitless does not take (multimodal inputs, MoE
router logits, an output it does not compute) goes to TRL's head, with one warning when
``fused_logprobs=True`` was asked for explicitly.

Also shared by every drop-in: the TRL version guard, the ``logitless/active`` metric, a PEFT
adapter on ``lm_head`` (``peft_config=`` or a wrapped model), and the DPO / KTO reference served
from a :class:`logitless.refcache.RefCache`. For the experimental trainers that materialize the
logits (CPO, ORPO): their switch resolution (:func:`attach_materialized`) and ``logits/*`` sums
(:func:`sum_logits`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import sys
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import trl
from trl.trainer.utils import FusedCausalLMOutput

from ..model_heads import (
    UnsupportedModelError,
    _base,
    add_hidden_states_forward,
    admit_unverified,
    find_head,
    head_inputs,
)
from ..objectives import head_loss, vocab_stats
from ..ops import Head, resolve_backend, stat_dtype_for
from . import TESTED_TRL
from .config import LogitlessConfig, Switches


class UnsupportedConfigError(ValueError):
    """A TRL option that cannot be combined with what was asked of logitless."""

# Per-token fields of TRL's FusedCausalLMOutput that logitless computes (all of TRL 1.16's).
SUPPORTED_OUTPUTS = frozenset({"log_probs", "entropy", "mean_logits", "is_top1", "log_sum_sq_probs"})
# Why fused_loss is off in a drop-in whose loss is TRL's code on the log-probs (DPO, KTO, RLOO).
_TRL_LOSS_ON_LOGPROBS = "the loss is TRL's own code on logitless log-probs (fused_logprobs)"
# Keyword arguments that only shape the backbone's text pass (padding-free batches included);
# any other non-None argument (pixel_values, output_router_logits, ...) sends the call to TRL's head.
BACKBONE_KWARGS = frozenset({"input_ids", "attention_mask", "position_ids", "use_cache", "cu_seq_lens_q",
                             "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "return_dict"})


def takes_fused_loss(sw: Switches, inputs: dict, batch_keys: frozenset[str], return_outputs: bool) -> bool:
    """Whether a preference drop-in's ``_compute_loss`` runs its fused pass on ``inputs``: the
    switch is on, no outputs are asked for, and nothing beyond the backbone's text arguments and
    the trainer's ``batch_keys`` is set (pixel values, router logits, ... go to TRL's own loss,
    with one warning when ``fused_loss=True`` was asked for explicitly)."""
    other = sorted(k for k, v in inputs.items() if v is not None and k not in BACKBONE_KWARGS | batch_keys)
    if sw.fused_loss and other and sw.config.fused_loss:
        sw.warn_once("fused_loss", f"inputs {other}")
    return sw.fused_loss and not return_outputs and not other


def attach(trainer: Any, config: LogitlessConfig | None, *, outputs: tuple[str, ...], temperature: float = 1.0,
           loss_problems: list[str] | None = None, logprobs_only: bool = False, ref_cache: Any = None) -> Switches:
    """Resolve ``config`` for ``trainer`` into ``trainer.logitless`` and put logitless behind the
    fused LM head of ``trainer.model`` (computing ``outputs``) and ``trainer.ref_model`` (log-probs).

    Args:
        trainer: a TRL 1.16 trainer whose ``__init__`` ran ``add_fused_lm_head``.
        config: what runs through logitless (``None``: everything that can).
        outputs: the per-token fields the trainer asked TRL's head for.
        temperature: the temperature TRL's head divides the logits by.
        loss_problems: trainer options the ``fused_loss`` path does not reproduce (``fused_loss``
            resolves off, with their names, when any).
        logprobs_only: the trainer has no ``fused_loss`` path (its loss is TRL's code on the
            log-probs): ``fused_loss`` resolves off, its reason ``loss_problems`` or else that one,
            and ``fused_logprobs=False`` alone is a deliberate "all off".
        ref_cache: when not ``None``, the reference is first served from it (:func:`use_ref_cache`).

    Raises:
        TypeError: ``config`` is not a :class:`LogitlessConfig`.
        UnsupportedConfigError: a LoRA adapter on the head with ``fused_logprobs`` resolved off.
        UnsupportedConfigError, RefCacheMismatchError: from :func:`use_ref_cache` (``ref_cache``).
    """
    if ref_cache is not None:
        use_ref_cache(trainer, ref_cache)
    if logprobs_only and not loss_problems:
        loss_problems = [_TRL_LOSS_ON_LOGPROBS]
    config = check_config(config)
    models = [m for m in (trainer.model, getattr(trainer, "ref_model", None))
              if m is not None and not isinstance(m, CachedReference)]
    head_problem, lora_head = discover_heads(models, config)
    missing = sorted(set(outputs) - SUPPORTED_OUTPUTS)
    if missing and head_problem is None:
        head_problem = f"the trainer's head must also compute {missing}, which logitless does not"
    sw = Switches.resolve(config, head_problem, list(loss_problems or []))
    trainer.logitless = sw
    if lora_head and not sw.fused_logprobs:
        raise UnsupportedConfigError(f"the model has a LoRA adapter on lm_head, which TRL's own head ignores; it needs "
                                     f"fused_logprobs on ({sw.why_not['fused_logprobs']})")
    if sw.fused_loss or sw.fused_logprobs:
        for m, wanted in zip(models, (tuple(outputs), ("log_probs",)), strict=False):  # ref_model may be None
            add_hidden_states_forward(m)
            _put_behind_fused_head(trainer, m, wanted, temperature)
    finish(trainer, sw, ("fused_logprobs",) if logprobs_only else ("fused_loss", "fused_logprobs"))
    return sw


def discover_heads(models: list[Any], config: LogitlessConfig) -> tuple[str | None, bool]:
    """``(problem, lora)`` for the heads of ``models``, found once at construction:
    ``problem`` is why logitless cannot take one (``None``: it can take all), ``lora`` whether any
    carries a LoRA adapter. With ``config.allow_unverified`` an unverified class is admitted first,
    after its check."""
    lora = False
    try:
        for m in models:
            if config.allow_unverified:
                admit_unverified(m)
            lora |= find_head(m).lora is not None
    except UnsupportedModelError as e:
        return str(e), lora
    return None, lora


def check_config(config: LogitlessConfig | None) -> LogitlessConfig:
    """``config``, or the default :class:`LogitlessConfig` for ``None``.

    Raises:
        TypeError: ``config`` is not a :class:`LogitlessConfig`.
    """
    config = LogitlessConfig() if config is None else config
    if not isinstance(config, LogitlessConfig):
        raise TypeError(f"logitless_config must be a LogitlessConfig, got {type(config).__name__}")
    return config


def finish(trainer: Any, sw: Switches, switches: tuple[str, ...] = ("fused_loss", "fused_logprobs")) -> None:
    """What every drop-in does once its switches are resolved: record the backend the passes
    resolve to, warn once when nothing runs through logitless (``switches``: those that apply),
    check TRL's version."""
    check_trl_version()
    if sw.active:
        sw.backend = _resolved_backend(trainer, sw)
    sw.warn_if_inactive(type(trainer).__name__, switches)


def _resolved_backend(trainer: Any, sw: Switches) -> str:
    """The backend ``sw.options.impl`` resolves to for the policy's head: its device, and the
    training dtype (TRL's ``bf16``/``fp16`` autocast, else the weight's)."""
    try:
        head = find_head(trainer.accelerator.unwrap_model(trainer.model))
    except UnsupportedModelError as e:  # not expected once a switch resolved on; reported, not raised
        return f"unresolved ({e})"
    args = trainer.args
    if getattr(args, "cast_lm_head_to_fp32", False):
        dtype = torch.float32
    elif getattr(args, "bf16", False) and head.weight.dtype != torch.float64:
        dtype = torch.bfloat16
    elif getattr(args, "fp16", False) and head.weight.dtype != torch.float64:
        dtype = torch.float16
    else:
        dtype = head.weight.dtype
    probe = torch.empty(0, device=head.weight.device, dtype=dtype)
    try:
        return resolve_backend(sw.options.impl, probe, head.lora is not None).NAME
    except ValueError as e:
        return f"unresolved ({e})"


@functools.cache
def check_trl_version() -> None:
    """Warn once per process when the installed TRL is not the release the drop-ins reproduce:
    they override TRL's private methods, which another release may have changed."""
    if not trl.__version__.startswith(TESTED_TRL + "."):
        warnings.warn(f"logitless: the TRL drop-ins reproduce TRL {TESTED_TRL}.*, found trl {trl.__version__}: "
                      f"check your losses against TRL's own path (trl_own_path) or install trl=={TESTED_TRL}.*",
                      UserWarning, stacklevel=5)


class ActiveMetric:
    """Mixin of the drop-ins: logs ``logitless/active`` (1.0 when a logitless pass runs in the
    trainer, 0.0 when it is the trainer's own code throughout) with TRL's metrics."""

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        sw = getattr(self, "logitless", None)
        if sw is not None:
            mode = "train" if self.model.training else "eval"
            metrics = getattr(self, "_metrics", None)
            if isinstance(metrics, dict) and mode in metrics:
                if metrics[mode]:  # a logging step of TRL's metrics, not the end-of-training summary
                    metrics[mode]["logitless/active"].append(float(sw.active))
            elif "loss" in logs:
                logs = {**logs, "logitless/active": float(sw.active)}
        return super().log(logs, *args, **kwargs)


class _NoTunerLayer:
    """Nothing is an instance of it: stands in for PEFT's ``BaseTunerLayer`` in a TRL trainer's
    ``lm_head`` check while :func:`lora_head_admitted` is active."""


@contextlib.contextmanager
def lora_head_admitted(trl_class: type, call_args: tuple, call_kwargs: dict) -> Iterator[None]:
    """While ``trl_class.__init__(*call_args, **call_kwargs)`` runs, let it accept a model whose
    ``lm_head`` carries a LoRA adapter, from ``peft_config=`` (TRL wraps the model inside
    ``__init__``) or a wrapped model.

    TRL 1.16 refuses such models (``isinstance(model.get_output_embeddings(), BaseTunerLayer)``
    in each trainer's ``__init__``) because its own head reads ``lm_head.weight`` and would ignore
    the adapter; logitless adds the adapter's term in every vocabulary block, and :func:`attach`
    refuses a configuration where TRL's head would run instead. The check is the only use of the
    name in those ``__init__``s except GRPO's ``cast_lm_head_to_fp32``, whose own refusal is kept
    (nothing is admitted then).
    """
    module = sys.modules[trl_class.__module__]
    args = inspect.signature(trl_class.__init__).bind_partial(None, *call_args, **call_kwargs).arguments.get("args")
    if not hasattr(module, "BaseTunerLayer") or getattr(args, "cast_lm_head_to_fp32", False):
        yield
        return
    saved = module.BaseTunerLayer
    module.BaseTunerLayer = _NoTunerLayer
    try:
        yield
    finally:
        module.BaseTunerLayer = saved


@contextlib.contextmanager
def trl_own_path(trainer: Any) -> Iterator[Any]:
    """Within the block, ``trainer`` runs TRL's own head and loss (every logitless switch off),
    for A/B checks against logitless on the same state."""
    saved = trainer.logitless
    trainer.logitless = dataclasses.replace(saved, fused_loss=False, fused_logprobs=False)
    try:
        yield trainer
    finally:
        trainer.logitless = saved


def head_pass(trainer: Any, model: Any, hidden: torch.Tensor) -> tuple[torch.Tensor, Head]:
    """``(hidden, head)`` of ``model``'s head for final hidden states ``hidden [..., H]`` (shape
    kept), in the autocast dtype (FSDP2: the unsharded weight), at temperature 1.

    Raises:
        UnsupportedModelError: ``model``'s head is not one logitless takes.
    """
    return head_inputs(hidden, find_head(trainer.accelerator.unwrap_model(model)))


def _put_behind_fused_head(trainer: Any, model: Any, outputs: tuple[str, ...], temperature: float) -> None:
    base = _base(model)
    if getattr(base, "_logitless_fused_head", False):
        return
    previous = base.forward  # add_hidden_states_forward's, itself over TRL's fused head
    text_config = base.config.get_text_config()

    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        sw = trainer.logitless
        other = sorted(k for k, v in kwargs.items() if v is not None and k not in BACKBONE_KWARGS)
        if getattr(text_config, "output_router_logits", False):
            other.append("output_router_logits (MoE aux loss)")
        if not fused_lm_head or not sw.fused_logprobs or other or args:
            if fused_lm_head and sw.fused_logprobs and sw.config.fused_logprobs:
                sw.warn_once("fused_logprobs", f"inputs {other or 'passed positionally'}")
            return previous(*args, fused_lm_head=fused_lm_head, labels=labels, shift_labels=shift_labels,
                            num_items_in_batch=num_items_in_batch, **kwargs)
        kwargs["use_cache"] = False
        hidden = previous(logitless_hidden_states=True, **kwargs)
        if shift_labels is None:
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        return _fused_output(trainer, self, hidden, labels, outputs, temperature, num_items_in_batch)

    base.forward = types.MethodType(forward, base)
    base._logitless_fused_head = True


def _fused_output(trainer, model, hidden, labels, outputs, temperature, num_items_in_batch) -> FusedCausalLMOutput:
    """TRL's ``FusedCausalLMOutput`` for ``hidden [B, T, H]`` predicting ``labels [B, T]``."""
    sw = trainer.logitless
    hidden, head = head_pass(trainer, model, hidden)
    head = head.at_temperature(temperature)
    labels = labels.to(hidden.device)
    mask = labels != -100
    st = vocab_stats(hidden, head, labels, entropy="entropy" in outputs, mean_logit="mean_logits" in outputs,
                     options=sw.options)
    detached = _detached_outputs(hidden, head, labels, sw.options, outputs)
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return FusedCausalLMOutput(
        loss=-st.logp.sum() / count, log_probs=st.logp, entropy=st.entropy,
        mean_logits=None if st.mean_logit is None else st.mean_logit.detach(), label_mask=mask, **detached)


# The non-differentiable fields of TRL's output that vocab_stats does not return: (name, dtype).
_DETACHED_OUTPUTS = (("is_top1", torch.bool), ("log_sum_sq_probs", None))


@torch.no_grad()
def _detached_outputs(hidden, head, labels, options, outputs) -> dict[str, torch.Tensor]:
    """Of ``outputs``, ``is_top1`` (whether each label has the largest logit, bool) and
    ``log_sum_sq_probs`` (``log Σ_v p_v²``, WPO's weight, statistics dtype), ``[B, T]`` each and
    ``False``/0 where ignored: one second, forward-only pass for both, since :func:`vocab_stats`
    returns neither."""
    wanted = [(name, dtype) for name, dtype in _DETACHED_OUTPUTS if name in outputs]
    if not wanted:
        return {}
    sdt = stat_dtype_for(hidden.dtype)
    flat = {name: torch.zeros(labels.numel(), dtype=dtype or sdt, device=labels.device) for name, dtype in wanted}

    def record(s):
        for name in flat:
            flat[name][s.positions] = getattr(s, name)
        return s.logp.sum() * 0

    frozen = dataclasses.replace(head, weight=head.weight.detach(),
                                 bias=None if head.bias is None else head.bias.detach())
    head_loss(hidden.detach(), frozen, labels, {"record": record}, stats=("logp", *flat),
              options=dataclasses.replace(options, mode="recompute"))
    return {name: x.view(labels.shape) for name, x in flat.items()}


# ---- the reference model's log-probs served from a RefCache (DPO, KTO) ---------------------

class CachedReference(torch.nn.Module):
    """Stands in for a TRL trainer's reference model: its fused-LM-head call
    ``ref_model(input_ids=, attention_mask=, labels=, fused_lm_head=True)`` returns the
    reference log-probs of ``labels`` (``[B, L-1]``, 0 where ``labels`` is -100, the cache's
    dtype) looked up in a :class:`logitless.refcache.RefCache` instead of running a model.

    Raises (at call):
        RefCacheMissError: a sequence the cache does not hold.
        ValueError: a call the cache cannot serve (no ``fused_lm_head``, pre-shifted labels,
            multimodal or other non-text inputs).
    """

    def __init__(self, cache: Any) -> None:
        super().__init__()
        self.cache = cache

    def forward(self, input_ids=None, attention_mask=None, labels=None, fused_lm_head=False, shift_labels=None,
                num_items_in_batch=None, **kwargs) -> FusedCausalLMOutput:
        other = sorted(k for k, v in kwargs.items() if v is not None and k not in BACKBONE_KWARGS)
        if not fused_lm_head or labels is None or shift_labels is not None or other or input_ids is None:
            raise ValueError("the reference is served from ref_cache, which answers only TRL's fused-head call on "
                             f"text (input_ids, attention_mask, labels); got fused_lm_head={fused_lm_head}, "
                             f"shift_labels={'set' if shift_labels is not None else None}, other inputs {other}")
        wanted = labels != -100
        values = self.cache.lookup(input_ids, attention_mask, loss_mask=wanted)  # [B, L], 0 where not wanted
        return FusedCausalLMOutput(log_probs=values[:, 1:], label_mask=wanted[:, 1:])


def use_ref_cache(trainer: Any, ref_cache: Any, temperature: float = 1.0) -> Any:
    """Serve ``trainer``'s reference log-probs from ``ref_cache`` (a :class:`RefCache` or its
    directory, opened against the policy's weights, the tokenizer and ``temperature``) and free
    the reference model TRL loaded. Returns the opened cache.

    Raises:
        UnsupportedConfigError: ``sync_ref_model`` (the reference moves) or
            ``precompute_ref_log_probs`` (TRL's own fixed reference; use one or the other).
        RefCacheMismatchError: the cache was built from other weights, tokenizer or temperature.
    """
    from ..refcache import RefCache, free_reference

    args = trainer.args
    if getattr(args, "sync_ref_model", False):
        raise UnsupportedConfigError("ref_cache holds a fixed reference; sync_ref_model=True moves it")
    if getattr(args, "precompute_ref_log_probs", False):
        raise UnsupportedConfigError("ref_cache and precompute_ref_log_probs=True both fix the reference log-probs; "
                                     "pass one of them")
    if not isinstance(ref_cache, RefCache):
        ref_cache = RefCache.open(ref_cache, model=trainer.accelerator.unwrap_model(trainer.model),
                                  tokenizer=trainer.processing_class, temperature=temperature)
    ref = getattr(trainer, "ref_model", None)
    if ref is not None and not isinstance(ref, CachedReference):
        free_reference(trainer.accelerator.unwrap_model(ref))
    # TRL's loss calls `self.ref_model(...)` whenever it is set (PEFT included: no adapter toggling).
    trainer.ref_model = CachedReference(ref_cache)
    trainer.logitless_ref_cache = ref_cache
    return ref_cache


def reference_records(trainer: Any, dataset: Any = None) -> Iterator[dict[str, torch.Tensor]]:
    """The sequences ``trainer`` (a TRL 1.16 DPO or KTO trainer) asks its reference model to
    score, as :func:`logitless.refcache.build` records, made by the trainer's own tokenization
    and collator (chat template, EOS, ``max_length`` truncation and KTO's mismatched KL pairs
    included): ``{"input_ids", "attention_mask", "loss_mask"}`` per sequence.

    Args:
        trainer: the trainer, built from your text dataset (``prompt``/``chosen``/``rejected``
            or ``prompt``/``completion``/``label`` rows).
        dataset: its prepared dataset to read (default ``trainer.train_dataset``; pass
            ``trainer.eval_dataset`` as well if you evaluate).

    Yields:
        One dict per sequence of 1-D ``[L]`` tensors, ``L`` the length of its collated batch
        (padding included, ``attention_mask`` 0 there); ``loss_mask`` is TRL's
        ``completion_mask``.
    """
    from torch.utils.data import DataLoader

    data = trainer.train_dataset if dataset is None else dataset
    loader = DataLoader(data, batch_size=trainer.args.per_device_train_batch_size, collate_fn=trainer.data_collator,
                        shuffle=False)
    for batch in loader:
        for prefix in ("", "KL_"):  # KTO's KL estimate scores (prompt, other completion) pairs too
            if prefix + "input_ids" not in batch:
                continue
            rows = zip(batch[prefix + "input_ids"], batch[prefix + "attention_mask"],
                       batch[prefix + "completion_mask"], strict=True)
            for ids, am, cm in rows:
                yield {"input_ids": ids, "attention_mask": am, "loss_mask": cm}


# ---------------------------------------------------------------- trainers that materialize logits (CPO, ORPO)


def materialized_logits_problems(trainer: Any) -> list[str]:
    """What a fused drop-in over a trainer that materializes the logits (TRL's experimental CPO and
    ORPO trainers) does not reproduce: its model kind, the MoE aux loss, and heads whose
    ``logits/*`` metric (the mean of every logit) is not :func:`sum_logits`."""
    out = []
    if trainer.is_encoder_decoder:
        out.append("an encoder-decoder model")
    if trainer.aux_loss_enabled:
        out.append("MoE router aux loss (output_router_logits)")
    head = find_head(trainer.accelerator.unwrap_model(trainer.model))
    if head.transform.softcap is not None:
        out.append("a soft-capped head (TRL's logits/* metric averages every logit, which logitless sums as a "
                   "matrix-vector product for heads linear in the hidden state only)")
    if head.shard is not None:
        out.append("a vocabulary-sharded or padded head (TRL's logits/* metric averages the model's own logits)")
    if head.lora is not None and head.lora.dropout is not None:
        out.append("a LoRA adapter on lm_head with dropout (TRL's logits/* metric)")
    return out


def sum_logits(hidden: torch.Tensor, head: Head) -> torch.Tensor:
    """``Σ_v z_v`` at every position of ``hidden [..., H]`` for a head linear in the hidden state
    (no soft-cap, no shard): ``(h · Σ_v w_v + Σ_v b_v + s · (h A^T) · Σ_v B_v) · scale / temperature``,
    accumulated in fp32 (fp64 for fp64 inputs). Returns ``[...]``."""
    dt = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    h = hidden.to(dt)
    total = h @ head.weight.detach().to(dt).sum(0)
    if head.bias is not None:
        total = total + head.bias.detach().to(dt).sum()
    if head.lora is not None:
        low = h @ head.lora.a.detach().to(dt).t()
        total = total + head.lora.scaling * (low @ head.lora.b.detach().to(dt).sum(0))
    return total * (head.transform.logit_scale / head.transform.temperature)


def paired_metrics(gather: Callable[[torch.Tensor], torch.Tensor], rewards: tuple[torch.Tensor, torch.Tensor],
                   logps: tuple[torch.Tensor, torch.Tensor], logits_sum: torch.Tensor,
                   vocab_size: int) -> dict[str, torch.Tensor]:
    """The reward, log-prob and mean-logit metrics TRL's experimental CPO and ORPO trainers log
    alike (``rewards/*``, ``logps/*``, ``logits/*``), as 0-dim tensors gathered over processes
    (``gather``: the accelerator's ``gather_for_metrics``). ``rewards``, ``logps``: ``(chosen,
    rejected)``, ``[B]`` each; ``logits_sum``: ``[2B, L]`` per-position logit sums (:func:`sum_logits`),
    chosen rows first."""
    (chosen_rewards, rejected_rewards), (chosen_logps, rejected_logps) = rewards, logps
    len_chosen, len_rejected = chosen_logps.shape[0], rejected_logps.shape[0]
    per_logit = logits_sum.shape[1] * vocab_size
    return {
        "rewards/chosen": gather(chosen_rewards).mean(),
        "rewards/rejected": gather(rejected_rewards).mean(),
        "rewards/accuracies": gather((chosen_rewards > rejected_rewards).float()).mean(),
        "rewards/margins": gather(chosen_rewards - rejected_rewards).mean(),
        "logps/rejected": gather(rejected_logps).mean(),
        "logps/chosen": gather(chosen_logps).mean(),
        "logits/rejected": gather(logits_sum[len_chosen:].sum() / (per_logit * len_rejected)).mean(),
        "logits/chosen": gather(logits_sum[:len_chosen].sum() / (per_logit * len_chosen)).mean(),
    }


def attach_materialized(trainer: Any, config: LogitlessConfig | None) -> None:
    """Resolve ``config`` into ``trainer.logitless`` for a trainer that materializes the logits
    and has no reference or separate log-prob pass (TRL's experimental CPO and ORPO trainers):
    only ``fused_loss`` applies; when it resolves on, the model returns its final hidden states
    on request (``logitless_hidden_states=True``).

    Raises:
        TypeError: ``config`` is not a :class:`LogitlessConfig`.
    """
    config = check_config(config)
    resolved = dataclasses.replace(config, fused_logprobs=False)
    model = trainer.accelerator.unwrap_model(trainer.model)
    head_problem, _ = discover_heads([model], config)  # admits an unverified class first, if allowed
    problems = materialized_logits_problems(trainer) if head_problem is None else []
    trainer.logitless = Switches.resolve(resolved, head_problem, problems)
    trainer.logitless.config = config
    if trainer.logitless.fused_loss:
        add_hidden_states_forward(model)
    finish(trainer, trainer.logitless, ("fused_loss",))
