"""Which part of the vocabulary a head weight holds: vocabulary (tensor) parallelism and
padded vocabularies, through ``torch.distributed`` collectives.

Each rank holds rows ``[vocab_start, vocab_start + V_local)`` of the head. A pass computes
per-token partial statistics over its rows, then one all-reduce MAX (the running max) and
one all-reduce SUM of a stacked tensor (``Σ exp``, ``Σ exp·z``, the owner's target logit,
``Σ z``) make them global (Megatron-style vocab-parallel cross-entropy). Backward: each rank
writes ``dz`` for its rows; ``d hidden`` partials are summed over the group unless the
caller's framework reduces them itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..distributed import is_active


@dataclass(frozen=True)
class VocabShard:
    """The vocabulary rows a ``weight [V_local, H]`` holds.

    Attributes:
        group: ``torch.distributed`` process group the vocabulary is split over (``None``: the
            whole vocabulary is local).
        vocab_start: global index of the first local row (default ``rank * V_local``: even
            shards; give it for uneven ones).
        vocab_size: true vocabulary size; rows at or beyond it are padding and get no
            probability (default: ``world * V_local``, i.e. no padding).
        reduce_grad_hidden: all-reduce the ``d hidden`` partials over ``group`` (set False when
            your framework reduces the input gradient of the head itself, e.g. Megatron's
            ``copy_to_tensor_model_parallel_region``).
    """

    group: object | None = None
    vocab_start: int | None = None
    vocab_size: int | None = None
    reduce_grad_hidden: bool = True

    def resolve(self, local_rows: int) -> tuple[int, int, int]:
        """``(vocab_start, vocab_size, valid local rows)``.

        Raises:
            ValueError: a start/size inconsistent with the local rows.
        """
        world, rank = 1, 0
        if is_active(self.group):
            import torch.distributed as dist

            world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        start = rank * local_rows if self.vocab_start is None else int(self.vocab_start)
        size = world * local_rows if self.vocab_size is None else int(self.vocab_size)
        if start < 0 or size <= 0:
            raise ValueError(f"VocabShard: vocab_start={start} and vocab_size={size} must be >= 0 and > 0")
        if not is_active(self.group) and start != 0:
            raise ValueError("VocabShard: vocab_start must be 0 without a vocabulary-parallel group")
        valid = max(0, min(local_rows, size - start))
        return start, size, valid
