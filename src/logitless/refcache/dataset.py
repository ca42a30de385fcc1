"""Dataset records → token-id sequences plus the positions whose log-prob is wanted.

Accepted records (any iterable of them: a list, a ``datasets.Dataset``, a loaded file):

* a list / 1-D array / tensor of token ids — every position ``t >= 1`` is computed;
* ``{"input_ids": [...], "loss_mask" | "completion_mask" | "assistant_masks": [...]}`` — the
  mask (same length) selects the positions computed; ``"attention_mask"``, when present,
  drops padding tokens from the sequence first;
* ``{"prompt_ids": [...], "completion_ids": [...]}`` with optional ``"prompt_mask"`` /
  ``"completion_mask"`` (TRL's layout): the sequence is the kept prompt tokens followed by
  the kept completion tokens, and the completion positions are computed.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

_MASK_KEYS = ("loss_mask", "completion_mask", "assistant_masks")


@dataclass
class Example:
    """One sequence to cache.

    Attributes:
        ids: ``[L]`` int64 token ids (``L >= 1``).
        mask: ``[L]`` bool, positions whose log-prob is wanted (position 0 never is), or
            ``None`` for every position.
    """

    ids: np.ndarray
    mask: np.ndarray | None


_INT64_MAX = 2**63 - 1


def _one_sequence(a: np.ndarray, where: str, name: str) -> np.ndarray:
    """``a`` if it is 1-D: a record is one sequence, and flattening a ``[B, T]`` batch (or a
    ``[1, T]`` tokenizer output) would silently cache one long sequence instead."""
    if a.ndim != 1:
        raise ValueError(f"{where}: {name} must be one sequence (1-D), got shape {a.shape}; give one record per "
                         "sequence (e.g. ids[0] of a [1, T] tokenizer output)")
    return a


def _arr(x: Any, dtype: Any, where: str, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    try:
        a = np.asarray(x, dtype=dtype)
    except (ValueError, TypeError) as e:  # ragged nesting
        raise ValueError(f"{where}: {name} must be a flat 0/1 sequence ({e})") from None
    return _one_sequence(a, where, name)


def _python_ids(x: list[int] | tuple[int, ...], where: str, name: str) -> np.ndarray:
    for pos, v in enumerate(x):
        if not -_INT64_MAX - 1 <= v <= _INT64_MAX:
            raise ValueError(f"{where}: {name} holds token id {int(v)} at position {pos}, outside any vocabulary "
                             "(token ids are 0 <= id < 2**63)")
    return np.array(x, dtype=np.int64)


def _ids(x: Any, where: str, name: str) -> np.ndarray:
    """Token ids as int64, refusing floats, booleans, ragged/object input (which a cast would
    silently truncate or misread), nested sequences and ids beyond int64 (which would wrap)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    if isinstance(x, (list, tuple)) and all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))
                                            for v in x):
        x = _python_ids(x, where, name)  # numpy would turn [1, 2**63] into floats
    try:
        a = np.asarray(x)
    except ValueError as e:  # ragged nesting
        raise TypeError(f"{where}: {name} must be a flat sequence of integer token ids ({e})") from None
    a = _one_sequence(a, where, name)
    ints = a.dtype.kind in "iu" or (a.dtype.kind == "O" and all(type(v) is int for v in a.tolist()))
    if a.size and not ints:
        raise TypeError(f"{where}: {name} must be integer token ids, got dtype {a.dtype} (e.g. {a[0]!r}); "
                        "cast them with int() only if they are whole numbers")
    if a.size and (a.dtype.kind == "O" or (a.dtype.kind == "u" and int(a.max()) > _INT64_MAX)):
        values = a.tolist()
        pos = next(i for i, v in enumerate(values) if not -_INT64_MAX - 1 <= v <= _INT64_MAX)
        raise ValueError(f"{where}: {name} holds token id {values[pos]} at position {pos}, outside any vocabulary "
                         "(token ids are 0 <= id < 2**63)")
    return a.astype(np.int64)


def to_example(rec: Any, where: str) -> Example:
    """Normalize one record (see the module docstring).

    Raises:
        ValueError: empty sequence, ids outside ``[0, 2**63)``, a record or mask that is not
            1-D, or a mask of the wrong length.
        TypeError: an unrecognized record, or token ids that are not integers.
    """
    if isinstance(rec, dict) and "prompt_ids" in rec:
        if "completion_ids" not in rec:
            raise TypeError(f"{where}: a record with 'prompt_ids' needs 'completion_ids', got {sorted(rec)}")
        p, c = _ids(rec["prompt_ids"], where, "prompt_ids"), _ids(rec["completion_ids"], where, "completion_ids")
        pm = _arr(rec.get("prompt_mask", np.ones(len(p))), bool, where, "prompt_mask")
        cm = _arr(rec.get("completion_mask", np.ones(len(c))), bool, where, "completion_mask")
        if len(pm) != len(p) or len(cm) != len(c):
            raise ValueError(f"{where}: prompt_mask/completion_mask lengths differ from prompt_ids/completion_ids")
        ids = np.concatenate([p[pm], c[cm]])
        mask = np.concatenate([np.zeros(int(pm.sum()), bool), np.ones(int(cm.sum()), bool)])
    elif isinstance(rec, dict):
        if "input_ids" not in rec:
            raise TypeError(f"{where}: a record needs 'input_ids' or 'prompt_ids'/'completion_ids', got {sorted(rec)}")
        ids = _ids(rec["input_ids"], where, "input_ids")
        key = next((k for k in _MASK_KEYS if rec.get(k) is not None), None)
        mask = None if key is None else _arr(rec[key], bool, where, key)
        if mask is not None and len(mask) != len(ids):
            raise ValueError(f"{where}: {key} has length {len(mask)} but input_ids has {len(ids)}")
        if rec.get("attention_mask") is not None:
            keep = _arr(rec["attention_mask"], bool, where, "attention_mask")
            if len(keep) != len(ids):
                raise ValueError(f"{where}: attention_mask has length {len(keep)} but input_ids has {len(ids)}")
            ids, mask = ids[keep], None if mask is None else mask[keep]
    elif isinstance(rec, (list, tuple, np.ndarray, torch.Tensor)):
        ids, mask = _ids(rec, where, "token ids"), None
    else:
        raise TypeError(f"{where}: unsupported record type {type(rec).__name__}")
    if len(ids) == 0:
        raise ValueError(f"{where}: empty sequence")
    if (ids < 0).any():
        raise ValueError(f"{where}: negative token id {int(ids.min())}")
    return Example(ids=np.ascontiguousarray(ids), mask=mask)


def to_examples(data: Iterable[Any]) -> list[Example]:
    return [to_example(rec, f"record {i}") for i, rec in enumerate(data)]


def load_records(path: str | Path) -> list[Any]:
    """Records from a ``.json`` (a list, or ``{"data": [...]}``), ``.jsonl`` or ``.parquet`` file.

    Raises:
        ValueError: another extension or a JSON document of another shape.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with path.open() as f:
            return [json.loads(line) for line in f if line.strip()]
    if suffix == ".json":
        doc = json.loads(path.read_text())
        doc = doc.get("data") if isinstance(doc, dict) else doc
        if not isinstance(doc, list):
            raise ValueError(f"{path}: expected a JSON list of records or {{'data': [...]}}")
        return doc
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise ValueError(f"{path}: unsupported dataset format {suffix!r} (use .json, .jsonl or .parquet)")
