"""Reference-cache storage: corruption and truncation are caught, never served; serving
memory stays flat with the cache size."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from logitless.refcache import (
    Fingerprint,
    PartWriter,
    RefCache,
    RefCacheCorruptError,
    RefCacheError,
    finalize,
    sequence_key,
)


def _fingerprint() -> Fingerprint:
    return Fingerprint(model_weights="synthetic", weights_hash_mode="given", model_class="none", vocab_size=1000,
                       hidden_size=8, tokenizer=None, dtype="float32", temperature=1.0, logit_scale=1.0, softcap=None,
                       library_version="test")


def _seq(i: int, length: int) -> np.ndarray:
    ids = np.zeros(length, np.int64)
    ids[0], ids[1] = i % 997, i // 997
    return ids


def _row(i: int, length: int) -> np.ndarray:
    row = np.float32(-i) - np.arange(length, dtype=np.float32) / 1024
    row[0] = np.nan
    return row


def _synthetic(root: Path, n: int, length: int, per_part: int) -> None:
    """A store of ``n`` sequences of ``length`` tokens written directly (no model)."""
    w = PartWriter(root, 0, np.float32)
    for start in range(0, n, per_part):
        idx = range(start, min(start + per_part, n))
        w.add([sequence_key(_seq(i, length)) for i in idx], [_row(i, length) for i in idx])
        w.flush()
    finalize(root, _fingerprint(), w.parts)


def _batch(idx: list[int], length: int) -> torch.Tensor:
    return torch.from_numpy(np.stack([_seq(i, length) for i in idx]))


def _expected(idx: list[int], length: int) -> torch.Tensor:
    rows = torch.from_numpy(np.stack([_row(i, length) for i in idx]))
    rows[:, 0] = 0
    return rows


def test_every_flipped_byte_is_caught_or_harmless(tmp_path):
    """Flip one byte at a time, at a stride covering every file; afterwards open + lookup
    either raises a RefCacheError or returns exactly the original values (the byte sat in
    part metadata serving never reads, and ``verify()`` reports it). Never a wrong number."""
    src = tmp_path / "src"
    _synthetic(src, n=6, length=5, per_part=3)
    idx, L = list(range(6)), 5
    want = _expected(idx, L)
    files = sorted(p for p in src.rglob("*") if p.is_file() and "state" not in p.name)
    caught = harmless = 0
    for f in files:
        data = f.read_bytes()
        for pos in range(0, len(data), 11):
            f.write_bytes(data[:pos] + bytes([data[pos] ^ 0x5A]) + data[pos + 1:])
            try:
                got = RefCache.open(src).lookup(_batch(idx, L))
            except RefCacheError:
                caught += 1
            else:
                assert torch.equal(got, want), f"wrong values served after flipping byte {pos} of {f.name}"
                harmless += 1
                with pytest.raises(RefCacheCorruptError):  # ... and verify() still reports it
                    RefCache.open(src).verify()
            f.write_bytes(data)
    assert caught > 0 and harmless > 0  # both kinds of byte were hit


def test_truncation_and_missing_files_are_named(tmp_path):
    _synthetic(tmp_path / "c", n=4, length=6, per_part=2)
    part = tmp_path / "c" / "parts" / "rank-00000" / "part-000001.arrow"
    data = part.read_bytes()
    part.write_bytes(data[:-10])
    with pytest.raises(RefCacheCorruptError, match=r"part-000001\.arrow.*truncated"):
        RefCache.open(tmp_path / "c")
    part.unlink()
    with pytest.raises(RefCacheCorruptError, match="no file"):
        RefCache.open(tmp_path / "c")
    (tmp_path / "c" / "manifest.json").unlink()
    with pytest.raises(RefCacheCorruptError, match="no manifest"):
        RefCache.open(tmp_path / "c")


def test_manifest_edit_is_detected(tmp_path):
    _synthetic(tmp_path / "c", n=2, length=3, per_part=2)
    m = tmp_path / "c" / "manifest.json"
    body = json.loads(m.read_text())
    body["fingerprint"]["temperature"] = 0.5  # hand-edited to pass a check
    m.write_text(json.dumps(body, indent=2, sort_keys=True))
    with pytest.raises(RefCacheCorruptError, match="manifest checksum"):
        RefCache.open(tmp_path / "c")


_SERVE = textwrap.dedent("""
    import resource, sys, numpy as np, torch
    sys.path.insert(0, sys.argv[2])
    from test_refcache_store import _batch, _expected
    from logitless.refcache import RefCache
    n, L = int(sys.argv[3]), int(sys.argv[4])
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cache = RefCache.open(sys.argv[1])
    cache.verify()  # rehashes every byte through read(), not the mapping
    rng = np.random.default_rng(0)
    for _ in range(8):
        idx = rng.choice(n, 16, replace=False).tolist()
        assert torch.equal(cache.lookup(_batch(idx, L)), _expected(idx, L))
    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)
""")


def test_serving_a_large_cache_keeps_rss_flat(tmp_path):
    """A ~256 MiB store (written directly); a fresh process verifies it fully and serves
    128 random rows while its peak RSS grows by far less than the file size."""
    n, L = 16384, 4096  # 16384 x 4096 fp32 = 256 MiB of values
    _synthetic(tmp_path / "big", n=n, length=L, per_part=2048)
    size = sum(p.stat().st_size for p in (tmp_path / "big").rglob("*.arrow"))
    assert size > 256 << 20
    out = subprocess.run([sys.executable, "-c", _SERVE, str(tmp_path / "big"), str(Path(__file__).parent), str(n),
                          str(L)], check=True, capture_output=True, text=True)
    grew = int(out.stdout.strip().splitlines()[-1])
    assert grew < size / 8, f"peak RSS grew by {grew / 2**20:.0f} MiB serving a {size / 2**20:.0f} MiB cache"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss > 0
