"""logitless: LLM output-head losses and metrics from hidden states and the head weight,
in one pass over the vocabulary, without materializing the ``(tokens x vocab)`` logits.

The public surface:

* :func:`policy_loss` - PPO/GRPO-family losses with TRL's semantics and metrics.
* :func:`vocab_stats` - differentiable per-token ``logp``/``lse``/``entropy``.
* :func:`token_logprobs` - no-grad log-probs (+ entropy) for rollouts / reference passes.
* :func:`distill_loss` - distillation (forward/reverse KL, generalized JSD, top-k teacher) from
  a student and a teacher head, neither's logits materialized.
* :func:`sequence_logps` + :func:`dpo_loss` / :func:`kto_loss` / :func:`cpo_loss` /
  :func:`simpo_loss` / :func:`orpo_loss` - preference objectives on sequence log-prob sums;
  :func:`dpo_loss_fused` / :func:`kto_loss_fused` / :func:`cpo_loss_fused` /
  :func:`simpo_loss_fused` / :func:`orpo_loss_fused` - the same losses in one fused pass
  (3 GEMMs of work).
* :func:`cross_entropy` - CE with label smoothing and z-loss; :func:`head_loss` - any sum of
  terms on the head's softmax in one pass.
* :func:`apply_logitless` - patch a Hugging Face causal LM so ``model(input_ids, labels=...)``
  returns its loss without the logits.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Each public name and the submodule that defines it. They are imported on first use (PEP 562):
# importing torch and its compiler stack takes seconds, which `logitless --help` should not pay.
_EXPORTS = {
    **dict.fromkeys(
        ("CPOLossConfig", "DistillConfig", "DPOLossConfig", "KTOLossConfig", "PolicyConfig", "SequenceLogps",
         "TokenStats", "cpo_loss", "cpo_loss_fused", "cross_entropy", "distill_loss", "dpo_loss", "dpo_loss_fused",
         "head_loss", "kto_loss", "kto_loss_fused", "orpo_loss", "orpo_loss_fused", "policy_loss",
         "sampling_correction", "sequence_logps", "simpo_loss", "simpo_loss_fused", "VocabStats", "token_logprobs",
         "vocab_stats"),
        ".objectives"),
    **dict.fromkeys(
        ("Head", "HeadLoRA", "LogitTransform", "PassOptions", "PassOutOfMemoryError", "VocabShard"),
        ".ops"),
    # Plain transformers (docs/transformers.md); transformers itself is read off the model.
    **dict.fromkeys(("LogitlessPatch", "apply_logitless"), ".integrations.hf_patch"),
}

if TYPE_CHECKING:  # what static tools and IDEs see
    from .integrations.hf_patch import LogitlessPatch, apply_logitless
    from .objectives import (
        CPOLossConfig,
        DistillConfig,
        DPOLossConfig,
        KTOLossConfig,
        PolicyConfig,
        SequenceLogps,
        TokenStats,
        VocabStats,
        cpo_loss,
        cpo_loss_fused,
        cross_entropy,
        distill_loss,
        dpo_loss,
        dpo_loss_fused,
        head_loss,
        kto_loss,
        kto_loss_fused,
        orpo_loss,
        orpo_loss_fused,
        policy_loss,
        sampling_correction,
        sequence_logps,
        simpo_loss,
        simpo_loss_fused,
        token_logprobs,
        vocab_stats,
    )
    from .ops import (
        Head,
        HeadLoRA,
        LogitTransform,
        PassOptions,
        PassOutOfMemoryError,
        VocabShard,
    )


# Subpackages reachable as attributes after a bare `import logitless`, as when it imported them eagerly.
_SUBMODULES = ("amp", "argtypes", "bench", "cli", "compile", "demo", "distributed", "integrations", "model_heads",
               "objectives", "ops", "refcache")


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'logitless' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__all__ = [
    "CPOLossConfig", "DPOLossConfig", "DistillConfig", "Head", "HeadLoRA", "KTOLossConfig", "LogitTransform",
    "LogitlessPatch", "PassOptions", "PassOutOfMemoryError", "PolicyConfig", "SequenceLogps", "TokenStats",
    "VocabShard", "VocabStats", "__version__", "apply_logitless", "cpo_loss", "cpo_loss_fused", "cross_entropy",
    "distill_loss", "dpo_loss", "dpo_loss_fused", "head_loss", "kto_loss", "kto_loss_fused", "orpo_loss",
    "orpo_loss_fused", "policy_loss", "sampling_correction", "sequence_logps", "simpo_loss", "simpo_loss_fused",
    "token_logprobs", "vocab_stats",
]
