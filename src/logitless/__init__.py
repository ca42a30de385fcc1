"""logitless: LLM output-head losses and metrics from hidden states and the head weight,
in one pass over the vocabulary, without materializing the ``(tokens x vocab)`` logits.

The public surface:

* :func:`policy_loss` - PPO/GRPO-family losses with TRL's semantics and metrics.
* :func:`vocab_stats` - differentiable per-token ``logp``/``lse``/``entropy``.
* :func:`token_logprobs` - no-grad log-probs (+ entropy) for rollouts / reference passes.
* :func:`distill_loss` - distillation (forward/reverse KL, generalized JSD, top-k teacher) from
  a student and a teacher head, neither's logits materialized.
* :func:`sequence_logps` + :func:`dpo_loss` / :func:`kto_loss` / :func:`cpo_loss` /
  :func:`simpo_loss` / :func:`orpo_loss` - preference objectives on sequence log-prob sums.
* :func:`cross_entropy` - CE with label smoothing and z-loss; :func:`head_loss` - any sum of
  terms on the head's softmax in one pass.
"""

from .objectives import PolicyConfig, TokenStats, cross_entropy, head_loss, policy_loss
from .ops import LogitTransform, VocabShard, VocabStats, token_logprobs, vocab_stats

__version__ = "0.1.0"

__all__ = ["LogitTransform", "PolicyConfig", "TokenStats", "VocabShard", "VocabStats", "__version__",
           "cross_entropy", "head_loss", "policy_loss", "token_logprobs", "vocab_stats"]
