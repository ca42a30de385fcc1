"""TRL 1.16's distillation trainers with the student–teacher divergence computed by logitless.

    from logitless.integrations.trl_distill import LogitlessDistillationTrainer as DistillationTrainer
    from logitless.integrations.trl_distill import LogitlessGKDTrainer as GKDTrainer

Both trainers' loss is a divergence between the student's and the teacher's next-token
distributions over the shared vocabulary: ``beta = 0`` the forward KL ``KL(q‖p)``, ``beta = 1``
the reverse KL ``KL(p‖q)``, else the generalized JSD with mixture ``m = β q + (1-β) p`` (``p``
student, ``q`` teacher; TRL's convention, GKD paper arXiv:2306.13649 Eq. 1). Here both backbones
return final hidden states and :func:`logitless.distill_loss` folds the student's and the
teacher's heads into one blocked vocabulary pass: neither side's ``[N, V]`` logits exist.
Generation (on-policy, ``lmbda``, ``seq_kd``, vLLM), data handling, normalization and metrics
stay TRL's own code.

* ``DistillationTrainer`` (``trl.trainer.distillation_trainer``): its ``_compute_loss`` is
  replaced; TRL's backbone call (``_get_last_hidden_state``, through ``_forward_redirection``),
  ``tool_mask``, the on-policy ``num_items_in_batch`` and the entropy metric are kept. TRL's own
  head here is already chunked (``ChunkedDivergenceFunction``) but keeps fp32 statistics: on a
  float64 model logitless matches the exact divergence to ~1e-16 (relative), TRL's kernel to ~1e-7.
* ``GKDTrainer`` (``trl.experimental.gkd``): its ``compute_loss`` is replaced; TRL computes
  full student and teacher logits there. Its loss is at temperature 1 whatever
  ``GKDConfig.temperature`` (which TRL 1.16 uses for sampling only), and so is this one.

Not wrapped: ``ServerDistillationTrainer`` / ``AsyncDistillation`` (the teacher is top-k
log-probs from a server: :func:`logitless.distill_loss` takes that sparse teacher directly, but
the trainers' loss is their own server plumbing), GOLD (cross-tokenizer ULD alignment, not a
shared-vocabulary softmax).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

import torch
from trl.trainer.distillation_trainer import DistillationTrainer

from ..model_heads import UnsupportedModelError, add_hidden_states_forward, admit_unverified, find_head
from ..objectives import DistillConfig, distill_loss
from .config import LogitlessConfig, Switches
from .trl_head import ActiveMetric, check_config, finish, head_pass, trl_own_path

if TYPE_CHECKING:
    from trl.experimental.gkd import GKDTrainer

# LogitlessGKDTrainer is importable too (module __getattr__, below); not listed so that `import *`
# does not import trl.experimental.
__all__ = ["LogitlessDistillationTrainer", "patch_distillation_trainer", "patch_gkd_trainer", "trl_own_path"]

# DistillationTrainer's multimodal batch keys (its `_compute_loss`): such a batch runs TRL's path.
_MULTIMODAL = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
               "token_type_ids", "mm_token_type_ids", "image_position_ids")
# Neither trainer asks a fused LM head for per-token log-probs: only the loss switch applies.
_NO_LOGPROBS = "the trainer takes no per-token log-probs; its divergence is fused_loss"


def _attach(trainer: Any, config: LogitlessConfig | None) -> Switches:
    """Resolve ``config`` for a distillation ``trainer`` into ``trainer.logitless``.

    Unlike :func:`~logitless.integrations.trl_head.attach`, nothing is put behind a fused LM head
    (these trainers never call one; the DistillationTrainer's model has none, so wrapping its
    forward would send ``fused_lm_head`` into transformers' forward during generation); the
    student and the teacher get ``logitless_hidden_states=True``.

    Raises:
        TypeError: ``config`` is not a :class:`LogitlessConfig`.
    """
    config = check_config(config)
    teacher = getattr(trainer, "teacher_model", None)
    head_problem, problems, rows = None, [], []
    if teacher is None:
        head_problem = "no teacher model (a teacher served elsewhere)"
    else:
        try:
            for role, m in (("student", trainer.model), ("teacher", teacher)):
                if config.allow_unverified:
                    admit_unverified(trainer.accelerator.unwrap_model(m))
                head = find_head(trainer.accelerator.unwrap_model(m))
                rows.append(head.weight.shape[0])
                if head.lora is not None or head.shard is not None:
                    problems.append(f"a LoRA adapter or vocabulary shard on the {role}'s head (distill_loss "
                                    "takes neither)")
        except UnsupportedModelError as e:
            head_problem = str(e)
    if len(rows) == 2 and rows[0] != rows[1]:  # TRL checks config.vocab_size; a padded head can still differ
        problems.append(f"student and teacher heads of {rows[0]} and {rows[1]} rows")
    sw = Switches.resolve(dataclasses.replace(config, fused_logprobs=None), head_problem, problems)
    sw.config, sw.fused_logprobs = config, False
    sw.why_not.setdefault("fused_logprobs", _NO_LOGPROBS)
    if config.fused_logprobs is True:
        sw.warn_once("fused_logprobs", _NO_LOGPROBS)
    if sw.fused_loss:
        for m in (trainer.model, teacher):
            add_hidden_states_forward(trainer.accelerator.unwrap_model(m))
    trainer.logitless = sw
    finish(trainer, sw, switches=("fused_loss",))
    return sw


class LogitlessDistillationTrainer(ActiveMetric, DistillationTrainer):
    """``trl.DistillationTrainer`` whose divergence comes from one logitless pass over both heads.

    Extra keyword argument: ``logitless_config`` (:class:`LogitlessConfig`), resolved into
    ``trainer.logitless`` (``fused_loss``: the divergence of ``_compute_loss``). A student or
    teacher whose head logitless cannot take (unverified class, LoRA on the head) resolves it off;
    a multimodal batch runs TRL's ``_compute_loss`` for that call (one warning when
    ``fused_loss=True`` was asked for).

    Raises:
        TypeError, ValueError: an invalid :class:`LogitlessConfig`; everything
        ``DistillationTrainer`` raises.
    """

    def __init__(self, *args: Any, logitless_config: LogitlessConfig | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _attach(self, logitless_config)

    def _compute_loss(self, unwrapped_student, inputs, num_items_in_batch):
        sw = self.logitless
        other = [k for k in _MULTIMODAL if inputs.get(k) is not None]
        if not sw.fused_loss or other:
            if sw.fused_loss and sw.config.fused_loss:
                sw.warn_once("fused_loss", f"multimodal inputs {other}")
            return DistillationTrainer._compute_loss(self, unwrapped_student, inputs, num_items_in_batch)
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        loss_mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            loss_mask = loss_mask * inputs["tool_mask"]
        keep = inputs["completion_ids"].size(1)
        hidden = self._get_last_hidden_state(unwrapped_student, input_ids, attention_mask, keep)
        self.teacher_model.eval()
        unwrapped_teacher = self.accelerator.unwrap_model(self.teacher_model)
        with torch.no_grad():
            # Through the teacher's wrapper, as TRL does, so FSDP/DeepSpeed gather its shards.
            teacher_hidden = self._forward_redirection(self.teacher_model, unwrapped_teacher,
                                                       self._get_last_hidden_state, unwrapped_teacher,
                                                       input_ids, attention_mask, keep)
        return _divergence(self, (unwrapped_student, hidden), (unwrapped_teacher, teacher_hidden), loss_mask != 0,
                           self.temperature, num_items_in_batch)


def __getattr__(name: str) -> Any:
    # trl.experimental warns on import (TRLExperimentalWarning): imported only when GKD is asked for,
    # so `import logitless.integrations.trl_distill` for the DistillationTrainer stays silent.
    if name == "LogitlessGKDTrainer":
        return _gkd_trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _gkd_trainer_class() -> type:
    """``LogitlessGKDTrainer``, built on first use (``trl.experimental.gkd`` imported then)."""
    from trl.experimental.gkd import GKDTrainer

    class LogitlessGKDTrainer(ActiveMetric, GKDTrainer):
        """``trl.experimental.gkd.GKDTrainer`` whose loss comes from one logitless pass over both heads.

        Extra keyword argument: ``logitless_config`` (:class:`LogitlessConfig`), resolved into
        ``trainer.logitless`` as for :class:`LogitlessDistillationTrainer`. ``return_outputs=True``
        (evaluation asking for the student's logits) runs TRL's ``compute_loss`` for that call.

        Raises:
            TypeError, ValueError: an invalid :class:`LogitlessConfig`; everything ``GKDTrainer`` raises.
        """

        def __init__(self, *args: Any, logitless_config: LogitlessConfig | None = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            _attach(self, logitless_config)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if not self.logitless.fused_loss or return_outputs:
                return GKDTrainer.compute_loss(self, model, inputs, return_outputs=return_outputs,
                                               num_items_in_batch=num_items_in_batch)
            kw = dict(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], use_cache=False,
                      logitless_hidden_states=True)
            hidden = model(**kw)
            self.teacher_model.eval()
            with torch.no_grad():
                teacher_hidden = self.teacher_model(**kw)
            # GKD scores every position whose next-token label is not -100 (prompt and padding are).
            mask = inputs["labels"][:, 1:] != -100
            loss, _, _ = _divergence(self, (model, hidden[:, :-1]), (self.teacher_model, teacher_hidden[:, :-1]), mask,
                                     1.0, num_items_in_batch)
            return loss

    LogitlessGKDTrainer.__module__ = __name__
    LogitlessGKDTrainer.__qualname__ = "LogitlessGKDTrainer"  # pickled by name through __getattr__
    return LogitlessGKDTrainer


def _divergence(trainer, student, teacher, mask, temperature, num_items_in_batch):
    """``(loss, entropy_sum, n_valid)`` as TRL's ``_chunked_divergence_loss`` returns them, for
    ``(model, hidden [B, K, H])`` pairs of the student and the teacher and ``mask [B, K]`` (bool)."""
    hidden, head = head_pass(trainer, *student)
    teacher_hidden, teacher_head = head_pass(trainer, *teacher)
    mask = mask.to(hidden.device)
    loss, metrics = distill_loss(hidden, head.at_temperature(temperature), teacher_hidden.to(hidden.device),
                                 teacher_head.at_temperature(temperature), mask=mask,
                                 config=DistillConfig(beta=trainer.beta), num_items_in_batch=num_items_in_batch,
                                 options=trainer.logitless.options)
    n_valid = mask.sum()
    # metrics are means over max(n_valid, 1) tokens; TRL returns the raw sum for its cross-rank mean.
    return loss, metrics["entropy"] * n_valid.clamp(min=1), n_valid


def patch_distillation_trainer(trainer: DistillationTrainer,
                               logitless_config: LogitlessConfig | None = None) -> LogitlessDistillationTrainer:
    """Turn an existing ``DistillationTrainer`` into a :class:`LogitlessDistillationTrainer` in place."""
    _attach(trainer, logitless_config)
    trainer.__class__ = LogitlessDistillationTrainer
    return trainer


def patch_gkd_trainer(trainer: GKDTrainer, logitless_config: LogitlessConfig | None = None) -> Any:
    """Turn an existing ``GKDTrainer`` into a :class:`LogitlessGKDTrainer` in place."""
    _attach(trainer, logitless_config)
    trainer.__class__ = _gkd_trainer_class()
    return trainer
