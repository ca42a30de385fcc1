"""Optional keyed MAC of a cache, for caches shared between users.

Checksums and the index's stamp catch accidents and hand edits, but anyone who can write the
cache directory can also recompute them (the library's own helpers do). A user who holds a
secret key can close that gap: a build or merge given the key writes ``manifest.hmac``, an
HMAC-SHA256 (RFC 2104, Python's :mod:`hmac`) of the exact bytes of ``manifest.json``. The
manifest records the size and blake2b of the index and of every part, and the index records a
checksum of every row, so the MAC covers every value served. Without the key nobody can
produce a MAC that verifies.

The key is read from the file given as ``key_file`` (its bytes; trailing whitespace and line
ends are dropped; ``~`` is expanded) or, when none is given, from the environment variable
``LOGITLESS_REFCACHE_KEY`` (its UTF-8 text); it must be at least 16 bytes. Once a key is held,
a cache without a MAC is refused as well, so stripping the MAC does not help a forger.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path

from .errors import RefCacheCorruptError, RefCacheMismatchError
from .files import read_bounded

KEY_ENV = "LOGITLESS_REFCACHE_KEY"
MAC_FILE = "manifest.hmac"
MIN_KEY_BYTES = 16
_ALGORITHM = "hmac-sha256"
_KEY_CHECK = b"logitless-refcache key check"
_MANIFEST = b"logitless-refcache manifest\n"


def load_key(key_file: str | os.PathLike[str] | None) -> bytes | None:
    """The MAC key: the bytes of ``key_file``, else ``$LOGITLESS_REFCACHE_KEY``, else ``None``.

    Raises:
        TypeError: ``key_file`` is not a path.
        ValueError: ``key_file`` cannot be read, or a key shorter than 16 bytes (naming where
            it came from).
    """
    if key_file is not None:
        if not isinstance(key_file, (str, os.PathLike)):
            raise TypeError(f"key_file must be a path to a file holding the key, got {type(key_file).__name__}")
        try:
            key, where = Path(key_file).expanduser().read_bytes().rstrip(), f"key_file {os.fspath(key_file)}"
        except OSError as e:
            raise ValueError(f"key_file {os.fspath(key_file)}: cannot read it ({e.strerror or e})") from None
    else:
        text = os.environ.get(KEY_ENV)
        if text is None:
            return None
        key, where = text.encode("utf-8", "surrogateescape").rstrip(), f"${KEY_ENV}"
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"{where}: the key is {len(key)} bytes; use at least {MIN_KEY_BYTES} random bytes "
                         "(e.g. `openssl rand -hex 32`)")
    return key


def _record(key: bytes, manifest: bytes) -> dict[str, str]:
    return {"algorithm": _ALGORITHM,
            "key_check": hmac.new(key, _KEY_CHECK, hashlib.sha256).hexdigest()[:16],
            "mac": hmac.new(key, _MANIFEST + manifest, hashlib.sha256).hexdigest()}


def mac_bytes(key: bytes, manifest: bytes) -> bytes:
    """Contents of ``manifest.hmac`` for the manifest bytes ``manifest``."""
    return json.dumps(_record(key, manifest), indent=2, sort_keys=True).encode()


def check_mac(root: Path, key: bytes | None, manifest: bytes) -> None:
    """Check ``root``'s ``manifest.hmac`` against ``key`` and the manifest bytes read.

    No key and no MAC file passes: an unkeyed cache is as trustworthy as whoever can write it.

    Raises:
        RefCacheMismatchError: a MAC but no key, a key but no MAC, or a MAC made with another
            key (``.fields`` has ``mac`` or ``key_check``).
        RefCacheCorruptError: an unreadable MAC file, or a MAC that does not match the
            manifest (the cache was changed after it was built with this key).
    """
    path = Path(root) / MAC_FILE
    present = os.path.lexists(path)
    if key is None:
        if present:
            raise RefCacheMismatchError(
                {"mac": (_ALGORITHM, None)},
                f"{root} (it was built with a key: pass key_file= / --key-file, or set {KEY_ENV})")
        return
    if not present:
        raise RefCacheMismatchError(
            {"mac": (None, _ALGORITHM)},
            f"{root} (a key is held, but the cache has no {MAC_FILE}: it was built without the key or its MAC was "
            "removed; rebuild it with the key)")
    try:
        stored = json.loads(read_bounded(root, MAC_FILE, 4096).decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        stored = e
    if not isinstance(stored, dict) or not all(isinstance(stored.get(k), str) for k in ("key_check", "mac")):
        raise RefCacheCorruptError(path, f"not a MAC record ({stored})",
                                   "Rebuild the cache with the key; do not use it as it is")
    want = _record(key, manifest)
    if not hmac.compare_digest(stored["key_check"], want["key_check"]):
        raise RefCacheMismatchError({"key_check": (stored["key_check"], want["key_check"])},
                                    f"{root} (its MAC was made with another key)")
    if stored.get("algorithm") != _ALGORITHM or not hmac.compare_digest(stored["mac"], want["mac"]):
        raise RefCacheCorruptError(path, "the MAC does not match manifest.json: the cache was changed after it was "
                                         "built with this key",
                                   "Rebuild the cache from the reference model with the key; do not use this one")
