"""Vocabulary layer: per-token statistics of the head's softmax, never materializing logits.
Knows nothing about RL; the objectives layer sits on top and talks to it through
:mod:`.engine` (``run_objective``, ``compute_stats``), :class:`Head` and :class:`PassOptions`."""

from .contract import Head, Started, StatRequest, VocabShard, as_head, defers_checks, resolve_backend
from .distill import DistillPass, DistillStats, check_shards, run_distill
from .engine import (
    ChunkObjective,
    ChunkStats,
    ObjectiveSpec,
    PassResult,
    ZeroRows,
    compute_stats,
    run_objective,
    start_pass,
)
from .lora import HeadLoRA
from .plan import Impl, Mode, PassOptions, PassOutOfMemoryError, as_options, stat_dtype_for
from .settings import LogitsPrecision
from .transform import LogitTransform
from .validate import (
    ValueChecks,
    check_count,
    check_device,
    check_devices,
    check_head_inputs,
    check_mask,
    check_target_range,
)

__all__ = [
    "ChunkObjective",
    "ChunkStats",
    "DistillPass",
    "DistillStats",
    "Head",
    "HeadLoRA",
    "Impl",
    "LogitTransform",
    "LogitsPrecision",
    "Mode",
    "ObjectiveSpec",
    "PassOptions",
    "PassOutOfMemoryError",
    "PassResult",
    "Started",
    "StatRequest",
    "ValueChecks",
    "VocabShard",
    "ZeroRows",
    "as_head",
    "as_options",
    "check_count",
    "check_device",
    "check_devices",
    "check_head_inputs",
    "check_mask",
    "check_shards",
    "check_target_range",
    "compute_stats",
    "defers_checks",
    "resolve_backend",
    "run_distill",
    "run_objective",
    "start_pass",
    "stat_dtype_for",
]
