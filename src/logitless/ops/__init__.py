"""Vocabulary layer: per-token statistics of the head's softmax, never materializing logits.
Knows nothing about RL; the objectives layer sits on top."""

from .backend import Impl, resolve_impl
from .fused import fused_objective
from .lora import HeadLoRA
from .plan import ChunkPlan, default_chunk_bytes
from .shard import VocabShard
from .transform import LogitTransform
from .validate import check_head_inputs
from .vocab_stats import VocabStats, stat_dtype_for, token_logprobs, vocab_stats

__all__ = [
    "ChunkPlan",
    "HeadLoRA",
    "Impl",
    "LogitTransform",
    "VocabShard",
    "VocabStats",
    "check_head_inputs",
    "default_chunk_bytes",
    "fused_objective",
    "resolve_impl",
    "stat_dtype_for",
    "token_logprobs",
    "vocab_stats",
]
