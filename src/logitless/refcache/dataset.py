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


def _arr(x: Any, dtype: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=dtype).reshape(-1)


def _ids(x: Any, where: str, name: str) -> np.ndarray:
    """Token ids as int64, refusing floats, booleans and ragged/object input (which a cast would
    silently truncate or misread)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    try:
        a = np.asarray(x).reshape(-1)
    except ValueError as e:  # ragged nesting
        raise TypeError(f"{where}: {name} must be a flat sequence of integer token ids ({e})") from None
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"{where}: {name} must be integer token ids, got dtype {a.dtype} (e.g. {a[0]!r}); "
                        "cast them with int() only if they are whole numbers")
    return a.astype(np.int64)


def to_example(rec: Any, where: str) -> Example:
    """Normalize one record (see the module docstring).

    Raises:
        ValueError: empty sequence, negative ids, or a mask of the wrong length.
        TypeError: an unrecognized record, or token ids that are not integers.
    """
    if isinstance(rec, dict) and "prompt_ids" in rec:
        if "completion_ids" not in rec:
            raise TypeError(f"{where}: a record with 'prompt_ids' needs 'completion_ids', got {sorted(rec)}")
        p, c = _ids(rec["prompt_ids"], where, "prompt_ids"), _ids(rec["completion_ids"], where, "completion_ids")
        pm = _arr(rec.get("prompt_mask", np.ones(len(p))), bool)
        cm = _arr(rec.get("completion_mask", np.ones(len(c))), bool)
        if len(pm) != len(p) or len(cm) != len(c):
            raise ValueError(f"{where}: prompt_mask/completion_mask lengths differ from prompt_ids/completion_ids")
        ids = np.concatenate([p[pm], c[cm]])
        mask = np.concatenate([np.zeros(int(pm.sum()), bool), np.ones(int(cm.sum()), bool)])
    elif isinstance(rec, dict):
        if "input_ids" not in rec:
            raise TypeError(f"{where}: a record needs 'input_ids' or 'prompt_ids'/'completion_ids', got {sorted(rec)}")
        ids = _ids(rec["input_ids"], where, "input_ids")
        key = next((k for k in _MASK_KEYS if rec.get(k) is not None), None)
        mask = None if key is None else _arr(rec[key], bool)
        if mask is not None and len(mask) != len(ids):
            raise ValueError(f"{where}: {key} has length {len(mask)} but input_ids has {len(ids)}")
        if rec.get("attention_mask") is not None:
            keep = _arr(rec["attention_mask"], bool)
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
