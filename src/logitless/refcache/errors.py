"""Named errors of the reference log-prob cache. Every failure to serve a correct value is
one of these; nothing falls back to a silently wrong number."""

from __future__ import annotations


class RefCacheError(Exception):
    """Base class of every reference-cache error."""


class RefCacheMissError(RefCacheError, KeyError):
    """A requested sequence (or a requested position of it) is not in the cache.

    Attributes:
        key: hex digest of the sequence's token ids (see :func:`~.fingerprint.sequence_key`).
        row: index of the sequence in the caller's batch.
        length: number of tokens of the sequence.
    """

    def __init__(self, message: str, *, key: str, row: int, length: int) -> None:
        super().__init__(message)
        self.message, self.key, self.row, self.length = message, key, row, length

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.message


class RefCacheMismatchError(RefCacheError, ValueError):
    """The cache was built for another model, tokenizer, dtype, temperature or logit
    transform than the one it is opened against (or a resumed build differs from the
    partial one on disk).

    Attributes:
        fields: ``{field: (cached, expected)}`` for every mismatching manifest field.
    """

    def __init__(self, fields: dict[str, tuple[object, object]], where: str) -> None:
        self.fields = fields
        detail = "; ".join(f"{k}: cache has {a!r}, expected {b!r}" for k, (a, b) in fields.items())
        super().__init__(f"reference cache {where} does not match: {detail}")


class RefCacheCorruptError(RefCacheError):
    """A cache file is missing, truncated, or fails its checksum.

    Attributes:
        path: the offending file.
    """

    def __init__(self, path: object, reason: str) -> None:
        self.path = str(path)
        super().__init__(f"reference cache file {self.path} is corrupt: {reason}")
