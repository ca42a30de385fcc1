"""logitless: LLM output-head losses and metrics from hidden states and the head weight,
in one pass over the vocabulary, without materializing the ``(tokens x vocab)`` logits.

The public surface:

* :func:`policy_loss` - PPO/GRPO-family losses with TRL's semantics and metrics.
* :func:`vocab_stats` - differentiable per-token ``logp``/``lse``/``entropy``.
* :func:`token_logprobs` - no-grad log-probs (+ entropy) for rollouts / reference passes.
"""

from .objectives import PolicyConfig, policy_loss
from .ops import LogitTransform, VocabStats, token_logprobs, vocab_stats

__version__ = "0.1.0"

__all__ = ["LogitTransform", "PolicyConfig", "VocabStats", "__version__", "policy_loss", "token_logprobs",
           "vocab_stats"]
