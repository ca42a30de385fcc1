"""logitless behind TRL 1.16's fused LM head, shared by the SFT / DPO / KTO / RLOO drop-ins.

TRL 1.16's trainers other than GRPO get every log-prob they use from one call,
``model(**inputs, labels=labels, fused_lm_head=True)`` (``trl.trainer.utils.add_fused_lm_head``),
which returns a ``FusedCausalLMOutput`` of per-token ``log_probs`` / ``entropy`` / ``mean_logits``
/ ``is_top1`` computed by TRL's chunked head. :func:`attach` puts logitless behind that call:
the backbone's final hidden states and the model's head (found by
:func:`~logitless.integrations.hf.find_head`) go through :func:`logitless.vocab_stats` (one
blocked vocabulary pass, fp32 statistics, no logits), and the trainer's own loss code runs on
the result unchanged — so every loss type, reference model, precomputed reference log-prob and
metric of the trainer is TRL's own code. A call logitless does not take (multimodal inputs, MoE
router logits, an output it does not compute) goes to TRL's head, with one warning when
``fused_logprobs=True`` was asked for explicitly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Iterator
from typing import Any

import torch
from trl.trainer.utils import FusedCausalLMOutput

from ..objectives import head_loss
from ..ops import Head, vocab_stats
from .config import LogitlessConfig, Switches
from .hf import UnsupportedModelError, _base, add_hidden_states_forward, find_head, head_inputs

# Per-token fields of TRL's FusedCausalLMOutput that logitless computes (log Σ p², WPO's weight, is not).
SUPPORTED_OUTPUTS = frozenset({"log_probs", "entropy", "mean_logits", "is_top1"})
# Keyword arguments that only shape the backbone's text pass (padding-free batches included);
# any other non-None argument (pixel_values, output_router_logits, ...) sends the call to TRL's head.
BACKBONE_KWARGS = frozenset({"input_ids", "attention_mask", "position_ids", "use_cache", "cu_seq_lens_q",
                             "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "return_dict"})


def attach(trainer: Any, config: LogitlessConfig | None, *, outputs: tuple[str, ...], temperature: float = 1.0,
           loss_problems: list[str] | None = None) -> Switches:
    """Resolve ``config`` for ``trainer`` into ``trainer.logitless`` and put logitless behind the
    fused LM head of ``trainer.model`` (computing ``outputs``) and ``trainer.ref_model`` (log-probs).

    Args:
        trainer: a TRL 1.16 trainer whose ``__init__`` ran ``add_fused_lm_head``.
        config: what runs through logitless (``None``: everything that can).
        outputs: the per-token fields the trainer asked TRL's head for.
        temperature: the temperature TRL's head divides the logits by.
        loss_problems: trainer options the ``fused_loss`` path does not reproduce (``fused_loss``
            resolves off, with their names, when any).

    Raises:
        TypeError: ``config`` is not a :class:`LogitlessConfig`.
    """
    config = LogitlessConfig() if config is None else config
    if not isinstance(config, LogitlessConfig):
        raise TypeError(f"logitless_config must be a LogitlessConfig, got {type(config).__name__}")
    models = [m for m in (trainer.model, getattr(trainer, "ref_model", None)) if m is not None]
    head_problem = None
    missing = sorted(set(outputs) - SUPPORTED_OUTPUTS)
    if missing:
        head_problem = f"the trainer's head must also compute {missing}, which logitless does not"
    try:
        for m in models:
            find_head(m)
    except UnsupportedModelError as e:
        head_problem = str(e)
    trainer.logitless = Switches.resolve(config, head_problem, list(loss_problems or []))
    if trainer.logitless.fused_loss or trainer.logitless.fused_logprobs:
        for m, wanted in zip(models, (tuple(outputs), ("log_probs",)), strict=False):  # ref_model may be None
            add_hidden_states_forward(m)
            _put_behind_fused_head(trainer, m, wanted, temperature)
    return trainer.logitless


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
    """``(hidden, head)`` of ``model``'s head for final hidden states ``hidden``, in the autocast
    dtype (FSDP2: the unsharded weight), at temperature 1."""
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
    is_top1 = _is_top1(hidden, head, labels, sw.options) if "is_top1" in outputs else None
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return FusedCausalLMOutput(
        loss=-st.logp.sum() / count, log_probs=st.logp, entropy=st.entropy,
        mean_logits=None if st.mean_logit is None else st.mean_logit.detach(), is_top1=is_top1, label_mask=mask)


@torch.no_grad()
def _is_top1(hidden, head, labels, options) -> torch.Tensor:
    """Whether each label has the largest logit (``[B, T]`` bool, False where ignored): a second,
    forward-only pass, since :func:`vocab_stats` does not return it."""
    flat = torch.zeros(labels.numel(), dtype=torch.bool, device=labels.device)

    def record(s):
        flat[s.positions] = s.is_top1
        return s.logp.sum() * 0

    frozen = dataclasses.replace(head, weight=head.weight.detach(),
                                 bias=None if head.bias is None else head.bias.detach())
    head_loss(hidden.detach(), frozen, labels, {"is_top1": record}, stats=("logp", "is_top1"),
              options=dataclasses.replace(options, mode="recompute"))
    return flat.view(labels.shape)
