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
"""

from .objectives import (
    CPOLossConfig,
    DistillConfig,
    DPOLossConfig,
    KTOLossConfig,
    PolicyConfig,
    SequenceLogps,
    TokenStats,
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
)
from .ops import (
    Head,
    HeadLoRA,
    LogitTransform,
    PassOptions,
    PassOutOfMemoryError,
    VocabShard,
    VocabStats,
    token_logprobs,
    vocab_stats,
)

__version__ = "0.1.0"

__all__ = [
    "CPOLossConfig", "DPOLossConfig", "DistillConfig", "Head", "HeadLoRA", "KTOLossConfig", "LogitTransform",
    "PassOptions", "PassOutOfMemoryError", "PolicyConfig",
    "SequenceLogps", "TokenStats", "VocabShard", "VocabStats", "__version__", "cpo_loss", "cross_entropy",
    "distill_loss", "dpo_loss", "head_loss", "kto_loss", "orpo_loss", "policy_loss", "sampling_correction",
    "sequence_logps", "simpo_loss", "token_logprobs", "vocab_stats",
]

# Plain transformers (docs/transformers.md). torch-only at import: transformers is read off the model.
from .integrations.hf_patch import LogitlessPatch, apply_logitless

__all__ += ["LogitlessPatch", "apply_logitless"]
__all__ += ["cpo_loss_fused", "dpo_loss_fused", "kto_loss_fused", "orpo_loss_fused", "simpo_loss_fused"]
