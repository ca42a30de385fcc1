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
import math
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from .errors import RefCacheCorruptError, RefCacheMismatchError
from .files import INDEX, check_data_name

FORMAT = "logitless-refcache"
FORMAT_VERSION = 2  # 2: the index is stamped with the manifest's binding digest
_SAMPLE_WINDOWS = 16
_SAMPLE_BYTES = 4096

HashMode = Literal["auto", "full", "sampled"]
FULL_HASH_ENV = "LOGITLESS_REFCACHE_FULL_HASH_BYTES"
_INT64_MAX = 2**63 - 1


def sequence_key(ids: np.ndarray | torch.Tensor | list[int]) -> bytes:
    """16-byte key of a token-id sequence ``[L]`` (any integer dtype; hashed as ``<i8``).

    Raises:
        TypeError: the ids are not integers (a float id would be truncated into another key).
    """
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(ids)
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.size and arr.dtype.kind == "u" and int(arr.max()) > _INT64_MAX:  # would wrap to a negative id
        raise ValueError(f"token id {int(arr.max())} is larger than any vocabulary (ids are < 2**63)")
    arr = np.ascontiguousarray(arr, dtype="<i8")
    return hashlib.blake2b(arr.tobytes(), digest_size=16, person=b"logitless-seq").digest()


def key_words(key: bytes) -> tuple[int, int]:
    """The key as two unsigned 64-bit words ``(hi, lo)``; the index is sorted by them."""
    hi, lo = np.frombuffer(key, dtype=">u8")
    return int(hi), int(lo)


def _full_hash_limit() -> int:
    raw = os.environ.get(FULL_HASH_ENV)
    if raw is None:
        return 4 << 30
    try:
        limit = int(raw.strip())
    except ValueError:
        limit = -1
    if limit < 0:
        raise ValueError(f"{FULL_HASH_ENV} must be a whole number of bytes >= 0 (e.g. {4 << 30} for 4 GiB), got "
                         f"{raw!r}; fix or unset it")
    return limit


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
        ValueError: a tensor is on the ``meta`` device (e.g. after :func:`free_reference`), or
            ``LOGITLESS_REFCACHE_FULL_HASH_BYTES`` is not a whole number of bytes >= 0.
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
    """Fingerprint of a tokenizer's vocabulary and special tokens (``get_vocab()``).

    Raises:
        TypeError: ``tokenizer`` has no ``get_vocab()`` (a path or a name instead of a tokenizer).
    """
    if not callable(getattr(tokenizer, "get_vocab", None)):
        hint = (" (a path or name: load it first with transformers.AutoTokenizer.from_pretrained)"
                if isinstance(tokenizer, (str, os.PathLike)) else "")
        raise TypeError(f"tokenizer must be a tokenizer object with get_vocab(), got {type(tokenizer).__name__} "
                        f"{tokenizer!r}{hint}")
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

    def digest(self) -> str:
        """blake2b-128 (hex) of every field, canonical JSON."""
        return _json_checksum(asdict(self), b"logitless-fp")

    def mismatches(self, expected: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
        """``{field: (ours, expected)}`` for each checked field present in ``expected`` that
        differs. ``None`` is a value like any other (``softcap=None``: no soft-capping), so a
        field not to compare must be left out."""
        out = {}
        for name in CHECKED_FIELDS:
            if name not in expected:
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

    def binding(self) -> str:
        """Digest of everything the index file cannot check by itself (fingerprint, value
        dtype, entropy, parts and their value offsets). :func:`~.store.finalize` stamps it into
        the index, whose blake2b the manifest records, so a manifest edited by hand (and its
        checksum recomputed) no longer matches its own index."""
        return _json_checksum({"fingerprint": self.fingerprint.digest(), "value_dtype": self.value_dtype,
                               "has_entropy": self.has_entropy, "parts": self.parts, "values_at": self.values_at,
                               "format_version": self.format_version}, b"logitless-bind")

    def to_json(self) -> str:
        body = asdict(self)
        body["checksum"] = _json_checksum(body)
        return json.dumps(body, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, data: bytes, path: object) -> Manifest:
        """Parse, self-check and validate a manifest (types, ranges, file names).

        Raises:
            RefCacheCorruptError: not UTF-8 JSON, wrong format, checksum mismatch, or a field of
                the wrong type/range, an unsafe file name, or counts that disagree.
            RefCacheMismatchError: a format version this library cannot read.
        """
        try:
            text = data.decode("utf-8") if isinstance(data, bytes) else data
            body = json.loads(text)
        except (ValueError, UnicodeDecodeError) as e:
            raise RefCacheCorruptError(path, f"unreadable manifest ({type(e).__name__}: {e})") from None
        if not isinstance(body, dict):
            raise RefCacheCorruptError(path, f"the manifest is a JSON {type(body).__name__}, not an object")
        if text != json.dumps(body, indent=2, sort_keys=True):  # a flipped space is JSON too
            raise RefCacheCorruptError(path, "manifest bytes differ from the form it is written in")
        checksum = body.pop("checksum", None)
        if checksum != _json_checksum(body):
            raise RefCacheCorruptError(path, "manifest checksum mismatch")
        if body.get("format") != FORMAT:
            raise RefCacheCorruptError(path, f"not a {FORMAT} manifest")
        if body.get("format_version") != FORMAT_VERSION:
            raise RefCacheMismatchError({"format_version": (body.get("format_version"), FORMAT_VERSION)},
                                        f"{path} (written by another logitless version: rebuild it with this one)")
        _validate(body, path)
        body["fingerprint"] = Fingerprint(**body["fingerprint"])
        return cls(**body)


_HEX32 = re.compile(r"[0-9a-f]{32}")
_DTYPES = ("float64", "float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")


def _validate(body: dict[str, Any], path: object) -> None:
    """Type, range and cross-field checks of a parsed manifest body (checksum already matched)."""
    def need(ok: object, what: str) -> None:
        if not ok:
            raise RefCacheCorruptError(path, f"manifest field {what}")

    def is_int(x: object, lo: int = 0) -> bool:
        return type(x) is int and x >= lo

    def is_num(x: object) -> bool:
        return type(x) in (int, float) and math.isfinite(x)

    want = {f.name for f in Manifest.__dataclass_fields__.values()}
    need(set(body) == want, f"set differs from this format's: extra {sorted(set(body) - want)}, "
                            f"missing {sorted(want - set(body))}")
    fp = body["fingerprint"]
    fields = set(Fingerprint.__dataclass_fields__)
    need(isinstance(fp, dict) and set(fp) == fields, "'fingerprint' lacks or adds keys")
    for k in ("model_weights", "model_class", "library_version"):
        need(isinstance(fp[k], str), f"fingerprint.{k} is not a string")
    need(fp["weights_hash_mode"] in ("full", "sampled", "given"), "fingerprint.weights_hash_mode is unknown")
    need(is_int(fp["vocab_size"], 1) and is_int(fp["hidden_size"], 1), "fingerprint vocab/hidden size is not >= 1")
    need(fp["tokenizer"] is None or isinstance(fp["tokenizer"], str), "fingerprint.tokenizer is not a string")
    need(fp["dtype"] in _DTYPES, "fingerprint.dtype is not a floating dtype")
    need(is_num(fp["temperature"]) and fp["temperature"] > 0, "fingerprint.temperature is not positive")
    need(is_num(fp["logit_scale"]), "fingerprint.logit_scale is not a finite number")
    need(fp["softcap"] is None or (is_num(fp["softcap"]) and fp["softcap"] > 0), "fingerprint.softcap is not > 0")
    need(body["value_dtype"] in ("float32", "float64"), "value_dtype is not float32 or float64")
    need(type(body["has_entropy"]) is bool, "has_entropy is not a boolean")
    need(is_int(body["num_sequences"]) and is_int(body["num_tokens"]), "num_sequences/num_tokens is not an int >= 0")
    need(isinstance(body["build"], dict) and isinstance(body["created_at"], str), "build/created_at has a wrong type")
    files, parts, at = body["files"], body["parts"], body["values_at"]
    need(isinstance(files, dict) and isinstance(parts, list) and isinstance(at, list),
         "files/parts/values_at has a wrong type")
    for name, rec in files.items():
        check_data_name(name, path)
        need(isinstance(rec, dict) and set(rec) == {"bytes", "blake2b"} and is_int(rec["bytes"])
             and isinstance(rec["blake2b"], str) and _HEX32.fullmatch(rec["blake2b"]),
             f"files[{name!r}] is not {{'bytes': int >= 0, 'blake2b': 32 hex digits}}")
    for name in parts:
        need(check_data_name(name, path) != INDEX, "parts lists the index")
    need(len(set(parts)) == len(parts) and set(files) == {INDEX, *parts},
         "'files' must list index.arrow and each part exactly once")
    need(len(at) == len(parts), f"values_at has {len(at)} entries for {len(parts)} parts")
    cols = {"logp", "entropy"} if body["has_entropy"] else {"logp"}
    for name, offsets in zip(parts, at, strict=True):
        need(isinstance(offsets, dict) and set(offsets) == cols
             and all(is_int(v) and v <= files[name]["bytes"] for v in offsets.values()),
             f"values_at of {name} is not {{{', '.join(sorted(cols))}: offset within the file}}")


def _json_checksum(body: dict[str, Any], person: bytes = b"logitless-man") -> str:
    canon = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(canon, digest_size=16, person=person).hexdigest()
