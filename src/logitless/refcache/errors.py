"""Named errors of the reference log-prob cache. Every failure to serve a correct value is
one of these; nothing falls back to a silently wrong number."""

from __future__ import annotations

import errno


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
    """A cache file is missing, truncated, not a regular file inside the cache directory, or
    fails its checksum or its consistency checks. The message ends with what to do.

    Args:
        path: the offending file.
        reason: what is wrong with it.
        advice: what to do (default: rebuild, or run ``logitless refcache verify``).

    Attributes:
        path, reason: as given.
    """

    def __init__(self, path: object, reason: str, advice: str | None = None) -> None:
        self.path, self.reason = str(path), reason
        advice = advice or ("Rebuild the cache (delete the directory and run the build again); "
                            "`logitless refcache verify <dir>` checks every file")
        super().__init__(f"reference cache file {self.path} is corrupt: {reason}. {advice}")


class RefCacheLockedError(RefCacheError, RuntimeError):
    """Another process is building (or merging) into the same cache directory.

    Attributes:
        path: the lock file.
        pid: the holder's process id as it recorded it, or ``None`` if unreadable.
    """

    def __init__(self, path: object, pid: int | None) -> None:
        self.path, self.pid = str(path), pid
        who = f"pid {pid}" if pid is not None else "pid unknown"
        super().__init__(f"another build holds this directory ({who}, lock {self.path}); wait for it to finish "
                         "or stop it (its lock is released when it exits, even if killed), or build into another "
                         "directory")


class RefCacheWriteError(RefCacheError, OSError):
    """Writing the cache failed (read-only directory, full disk, permissions). Every file is
    written to a temporary name and renamed, so what was on disk before is unchanged.

    Attributes:
        errno, strerror, filename: those of the underlying ``OSError``.
    """

    def __init__(self, path: object, err: OSError) -> None:
        super().__init__(err.errno, err.strerror)
        self.filename = str(path)
        self.message = (f"cannot write the reference cache file {path}: {err.strerror or err} "
                        f"[{errno.errorcode.get(err.errno or 0, 'errno ?')}]; files already in the cache are "
                        "unchanged. Free disk space or make the directory writable, then rerun the build (it "
                        "resumes after the last complete part)")

    def __str__(self) -> str:
        return self.message
