"""What a cache is valid for: sequence keys, model/tokenizer fingerprints, and the manifest.

* A **sequence key** is ``blake2b-128`` of the token ids as little-endian int64 bytes; the
  cache maps keys to rows. Two different sequences collide with probability ~2^-128 per pair
  (the length is stored and checked as well).
* The **weights fingerprint** is ``blake2b-128`` over the model's ``state_dict()`` in sorted
  name order, each entry contributing its name, dtype, shape and raw bytes (``"full"`` mode).
  Models whose state is larger than ``LOGITLESS_REFCACHE_FULL_HASH_BYTES`` (default 4 GiB) are
  hashed in ``"sampled"`` mode: name, dtype, shape and 16 evenly spaced 4 KiB windows of each
  tensor (first and last bytes included). Sampled mode still catches any change of a tensor's
  name/shape/dtype and any change that touches a sampled window (a fine-tune moves nearly
  every element), not an edit confined to unsampled bytes. The manifest records the mode and
  checks recompute with the same mode.
* The **tokenizer fingerprint** is ``blake2b-128`` over the sorted vocabulary (token → id,
  added tokens included) and the special tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from .errors import RefCacheCorruptError, RefCacheMismatchError

FORMAT = "logitless-refcache"
FORMAT_VERSION = 1
_SAMPLE_WINDOWS = 16
_SAMPLE_BYTES = 4096

HashMode = Literal["auto", "full", "sampled"]


def sequence_key(ids: np.ndarray | torch.Tensor | list[int]) -> bytes:
    """16-byte key of a token-id sequence ``[L]`` (any integer dtype; hashed as ``<i8``)."""
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    arr = np.ascontiguousarray(ids, dtype="<i8")
    return hashlib.blake2b(arr.tobytes(), digest_size=16, person=b"logitless-seq").digest()


def key_words(key: bytes) -> tuple[int, int]:
    """The key as two unsigned 64-bit words ``(hi, lo)``; the index is sorted by them."""
    hi, lo = np.frombuffer(key, dtype=">u8")
    return int(hi), int(lo)


def _full_hash_limit() -> int:
    return int(os.environ.get("LOGITLESS_REFCACHE_FULL_HASH_BYTES", 4 << 30))


def _tensor_bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy()


def weights_fingerprint(module: torch.nn.Module, mode: HashMode = "auto") -> tuple[str, str]:
    """Fingerprint of a module's weights (its ``state_dict()``, buffers included).

    Args:
        module: the model; may live on any device (tensors are copied to the CPU one by one).
        mode: ``"full"``, ``"sampled"``, or ``"auto"`` (full up to the size limit).

    Returns:
        ``(hex digest, mode used)``.

    Raises:
        ValueError: a tensor is on the ``meta`` device (e.g. after :func:`free_reference`).
    """
    items = sorted(module.state_dict().items())
    total = sum(t.numel() * t.element_size() for _, t in items)
    if mode == "auto":
        mode = "full" if total <= _full_hash_limit() else "sampled"
    if mode not in ("full", "sampled"):
        raise ValueError(f"mode must be 'auto', 'full' or 'sampled', got {mode!r}")
    h = hashlib.blake2b(digest_size=16, person=b"logitless-wts")
    for name, t in items:
        if t.is_meta:
            raise ValueError(f"cannot fingerprint {name}: it is on the meta device (was the model freed?)")
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        flat = t.detach().reshape(-1)
        nbytes = flat.numel() * flat.element_size()
        if mode == "full" or nbytes <= _SAMPLE_WINDOWS * _SAMPLE_BYTES:
            h.update(_tensor_bytes(flat))
            continue
        win = max(1, _SAMPLE_BYTES // flat.element_size())
        starts = np.linspace(0, flat.numel() - win, _SAMPLE_WINDOWS).astype(np.int64)
        idx = torch.from_numpy(starts[:, None] + np.arange(win)[None, :]).reshape(-1).to(flat.device)
        h.update(_tensor_bytes(flat[idx]))
    return h.hexdigest(), mode


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Fingerprint of a tokenizer's vocabulary and special tokens (``get_vocab()``)."""
    vocab = sorted((str(k), int(v)) for k, v in tokenizer.get_vocab().items())
    special = sorted(str(s) for s in (getattr(tokenizer, "all_special_tokens", None) or []))
    payload = json.dumps({"vocab": vocab, "special": special}, separators=(",", ":")).encode()
    return hashlib.blake2b(payload, digest_size=16, person=b"logitless-tok").hexdigest()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# Fields compared when a cache is opened against a model, in the order errors list them.
CHECKED_FIELDS = ("dtype", "temperature", "logit_scale", "softcap", "vocab_size", "model_weights", "tokenizer")


@dataclass
class Fingerprint:
    """What the cached values depend on.

    Attributes:
        model_weights: weights fingerprint (hex) of the reference model.
        weights_hash_mode: ``"full"`` or ``"sampled"``.
        model_class: class name of the model (informational).
        vocab_size: ``V`` of the head.
        hidden_size: ``H`` of the head.
        tokenizer: tokenizer fingerprint or ``None`` when none was given.
        dtype: compute dtype of the head and hidden states (e.g. ``"bfloat16"``).
        temperature, logit_scale, softcap: the logit transform (see ``LogitTransform``).
        library_version: logitless version that built the cache (informational).
    """

    model_weights: str
    weights_hash_mode: str
    model_class: str
    vocab_size: int
    hidden_size: int
    tokenizer: str | None
    dtype: str
    temperature: float
    logit_scale: float
    softcap: float | None
    library_version: str

    def mismatches(self, expected: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
        """``{field: (ours, expected)}`` for each checked field present (not ``None``) in
        ``expected`` that differs."""
        out = {}
        for name in CHECKED_FIELDS:
            if name not in expected or expected[name] is None:
                continue
            ours, theirs = getattr(self, name), expected[name]
            if ours != theirs:
                out[name] = (ours, theirs)
        return out


@dataclass
class Manifest:
    """``manifest.json``: the fingerprint, contents and checksums of a cache directory.

    Attributes:
        fingerprint: see :class:`Fingerprint`.
        value_dtype: dtype of stored values (``"float32"``, ``"float64"`` for fp64 models).
        has_entropy: whether per-token entropies are stored.
        num_sequences: distinct sequences.
        num_tokens: stored positions (sum of lengths).
        files: ``{relative path: {"bytes": int, "blake2b": hex}}`` of the index and parts.
        parts: part files in part-id order (the index refers to them by position).
        values_at: per part, byte offset of each value column's flat buffer in the file.
        build: build settings (batch size, world size, dataset plan digest).
        created_at: ISO-8601 UTC time of the merge.
    """

    fingerprint: Fingerprint
    value_dtype: str
    has_entropy: bool
    num_sequences: int
    num_tokens: int
    files: dict[str, dict[str, Any]]
    parts: list[str]
    values_at: list[dict[str, int]]
    build: dict[str, Any] = field(default_factory=dict)
    created_at: str = ""
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        body = asdict(self)
        body["checksum"] = _json_checksum(body)
        return json.dumps(body, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, path: object) -> Manifest:
        """Parse and self-check a manifest.

        Raises:
            RefCacheCorruptError: unparsable, wrong format, or its checksum does not match.
            RefCacheMismatchError: a format version this library cannot read.
        """
        try:
            body = json.loads(text)
            checksum = body.pop("checksum")
        except (ValueError, KeyError, AttributeError) as e:
            raise RefCacheCorruptError(path, f"unreadable manifest ({e})") from None
        if checksum != _json_checksum(body):
            raise RefCacheCorruptError(path, "manifest checksum mismatch")
        if body.get("format") != FORMAT:
            raise RefCacheCorruptError(path, f"not a {FORMAT} manifest")
        if body.get("format_version") != FORMAT_VERSION:
            raise RefCacheMismatchError({"format_version": (body.get("format_version"), FORMAT_VERSION)},
                                        f"{path}")
        try:
            body["fingerprint"] = Fingerprint(**body["fingerprint"])
            return cls(**body)
        except TypeError as e:
            raise RefCacheCorruptError(path, f"manifest fields do not match this library ({e})") from None


def _json_checksum(body: dict[str, Any]) -> str:
    canon = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(canon, digest_size=16, person=b"logitless-man").hexdigest()
