"""On-disk format: Arrow IPC files (uncompressed, memory-mappable, no pickle).

Layout of a cache directory::

    manifest.json                      # Manifest: fingerprint, counts, file sizes + blake2b
    index.arrow                        # one row per sequence, sorted by key
    parts/rank-00000/part-000000.arrow # values, one row per sequence
    parts/rank-00000/state.json        # build bookkeeping (resume), done.json when finished

A **part** has columns ``key_hi, key_lo`` (uint64, the 16-byte sequence key big-endian),
``length`` (int32), ``logp_crc`` / ``entropy_crc`` (uint64, blake2b-64 of the row's value
bytes) and ``logp`` / ``entropy`` (``large_list<float32|float64>``, one value per token,
``NaN`` where not computed). The **index** has ``key_hi, key_lo, part, offset, length,
logp_crc, entropy_crc``: ``offset`` is the row's start in the part's flat value buffer.

Serving memory-maps the index (binary search touches O(log n) pages) and reads each row's
values with ``os.pread`` at a byte offset the manifest records per part, so the values never
enter the process's resident set and RAM stays flat with the cache size.

Integrity: every file is written to a temporary name, fsynced and renamed into place, and
``manifest.json`` is written last (a directory without it is not a cache). The manifest
records each file's size and blake2b; opening checks sizes and the index checksum, every
served row is checked against its row checksum and its values against what a model can
compute, and :meth:`Store.verify` rehashes all files. A cache built with a key also carries
``manifest.hmac``, checked before the manifest is parsed (see :mod:`.mac`).
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from .errors import RefCacheCorruptError
from .files import (
    INDEX,
    atomic_write,
    buffer_digest,
    check_part_name,
    digest_fd,
    file_digest,
    make_dir,
    open_regular,
    read_bounded,
    remove_stale_temporaries,
)
from .fingerprint import Fingerprint, Manifest, key_words
from .mac import MAC_FILE, mac_bytes
from .mac import check_mac as _check_mac

MANIFEST = "manifest.json"
PARTS = "parts"
# A log-prob is z_y - lse(z) <= 0; where a kernel rounds the target logit apart from the same logit
# inside lse, a probability of ~1 can come out a few ulps above 0. Anything beyond this is not a
# log-prob (a forged or miscomputed row) and is never served.
LOGP_SLACK = 1e-3
_INDEX_SCHEMA = pa.schema([("key_hi", pa.uint64()), ("key_lo", pa.uint64()), ("part", pa.int32()),
                           ("offset", pa.int64()), ("length", pa.int32()), ("logp_crc", pa.uint64()),
                           ("entropy_crc", pa.uint64())])
__all__ = ["INDEX", "MANIFEST", "PARTS", "PartWriter", "Store", "atomic_write", "buffer_digest", "file_digest",
           "finalize", "remove_stale_temporaries"]


# --- files -------------------------------------------------------------------------------

def row_checksum(values: np.ndarray) -> int:
    """blake2b-64 of a row's value bytes, as an unsigned int (0 for an absent row)."""
    return int.from_bytes(hashlib.blake2b(memoryview(np.ascontiguousarray(values)).cast("B"),
                                          digest_size=8).digest(), "little")


def value_offsets(whole: pa.Buffer) -> dict[str, int]:
    """Byte offsets, within an Arrow IPC part file given as one buffer, of the flat
    ``logp``/``entropy`` value buffers (serving reads rows from there with ``pread``)."""
    t = pa.ipc.open_file(pa.BufferReader(whole)).read_all()
    out = {}
    for name in ("logp", "entropy"):
        if name in t.column_names:
            flat = _column(t, name).values
            out[name] = flat.buffers()[1].address - whole.address + flat.offset * flat.type.byte_width
    return out


def _column(table: pa.Table, name: str) -> pa.Array:
    col = table.column(name)
    return col.chunk(0) if col.num_chunks == 1 else pa.concat_arrays(col.chunks)


# --- writing -----------------------------------------------------------------------------

def _list_array(rows: Sequence[np.ndarray], dtype: np.dtype) -> pa.Array:
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(rows).astype(dtype, copy=False) if rows else np.zeros(0, dtype)
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(flat))


class PartWriter:
    """Appends rows for one rank and writes them as numbered, immutable part files.

    Args:
        root: cache directory.
        rank: data-parallel rank; parts go to ``parts/rank-{rank:05d}/``.
        value_dtype: ``np.float32`` or ``np.float64``.
    """

    def __init__(self, root: Path, rank: int, value_dtype: np.dtype) -> None:
        self.dir = Path(root) / PARTS / f"rank-{rank:05d}"
        make_dir(self.dir)
        self.value_dtype = np.dtype(value_dtype)
        self.parts: list[dict[str, Any]] = [read_part_meta(p) for p in sorted(self.dir.glob("part-*.arrow"))]
        self._keys: list[bytes] = []
        self._logp: list[np.ndarray] = []
        self._entropy: list[np.ndarray] = []
        self.pending_bytes = 0

    def add(self, keys: Sequence[bytes], logp: Sequence[np.ndarray],
            entropy: Sequence[np.ndarray] | None = None) -> None:
        """Buffer rows: ``keys[i]`` (16 bytes), ``logp[i]`` ``[L_i]`` and optionally ``entropy[i]``."""
        if len(keys) != len(logp) or (entropy is not None and len(entropy) != len(keys)):
            raise ValueError("keys, logp and entropy must have one entry per sequence")
        if self._keys and (entropy is None) != (not self._entropy):
            raise ValueError("entropy must be given for all rows of a part or for none")
        self._keys += keys
        self._logp += [np.asarray(r, self.value_dtype) for r in logp]
        if entropy is not None:
            self._entropy += [np.asarray(r, self.value_dtype) for r in entropy]
        self.pending_bytes += sum(len(r) for r in logp) * self.value_dtype.itemsize * (1 + (entropy is not None))

    def flush(self, meta: dict[str, str] | None = None) -> dict[str, Any] | None:
        """Write buffered rows as the next part (atomically); ``meta`` goes into its schema
        metadata. Returns the part's record ``{"name", "bytes", "blake2b", "meta"}`` or ``None``
        when nothing was buffered."""
        if not self._keys:
            return None
        words = np.array([key_words(k) for k in self._keys], dtype=np.uint64).reshape(-1, 2)
        cols = {
            "key_hi": pa.array(np.ascontiguousarray(words[:, 0])),
            "key_lo": pa.array(np.ascontiguousarray(words[:, 1])),
            "length": pa.array(np.array([len(r) for r in self._logp], np.int32)),
            "logp_crc": pa.array(np.array([row_checksum(r) for r in self._logp], np.uint64)),
            "entropy_crc": pa.array(np.array([row_checksum(r) for r in self._entropy] if self._entropy
                                             else np.zeros(len(self._keys)), np.uint64)),
            "logp": _list_array(self._logp, self.value_dtype),
        }
        if self._entropy:
            cols["entropy"] = _list_array(self._entropy, self.value_dtype)
        meta = {k: str(v) for k, v in (meta or {}).items()}  # as stored, so a resumed build records the same
        table = pa.table(cols).replace_schema_metadata(meta)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, table.schema) as w:
            w.write_table(table)
        buf = sink.getvalue()
        name = f"part-{len(self.parts):06d}.arrow"
        atomic_write(self.dir / name, buf)
        rec = {"name": f"{self.dir.name}/{name}", "bytes": buf.size, "blake2b": buffer_digest(buf), "meta": meta,
               "values_at": value_offsets(buf)}
        self.parts.append(rec)
        self._keys, self._logp, self._entropy, self.pending_bytes = [], [], [], 0
        return rec


def _map_regular(root: Path, name: str) -> pa.Buffer:
    """The regular file ``root / name`` (no symbolic link on the way) memory-mapped read-only."""
    fd, size = open_regular(root, name)
    try:
        return pa.py_buffer(mmap.mmap(fd, size, prot=mmap.PROT_READ)) if size else pa.py_buffer(b"")
    except (OSError, ValueError) as e:
        raise RefCacheCorruptError(Path(root) / name, f"cannot be mapped ({e})") from None
    finally:
        os.close(fd)


def _schema_meta(schema: pa.Schema) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in (schema.metadata or {}).items()}


def read_part_meta(path: Path) -> dict[str, Any]:
    """A part's record (as :meth:`PartWriter.flush` returns it), hashing the file.

    Raises:
        RefCacheCorruptError: unreadable part, or a symbolic link.
    """
    whole = _map_regular(path.parent, path.name)
    try:
        schema = pa.ipc.open_file(pa.BufferReader(whole)).schema
        at = value_offsets(whole)
    except (pa.ArrowException, OSError) as e:
        raise RefCacheCorruptError(path, f"not a readable Arrow IPC file ({e})") from None
    return {"name": f"{path.parent.name}/{path.name}", "bytes": whole.size, "blake2b": buffer_digest(whole),
            "meta": _schema_meta(schema), "values_at": at}


def part_metadata(root: Path, name: str) -> dict[str, str]:
    """Schema metadata of the part ``parts/<name>`` (reads its footer only).

    Raises:
        RefCacheCorruptError: not a regular file inside ``root``, or not an Arrow IPC file.
    """
    try:
        return _schema_meta(pa.ipc.open_file(pa.BufferReader(_map_regular(root, f"{PARTS}/{name}"))).schema)
    except (pa.ArrowException, OSError) as e:
        raise RefCacheCorruptError(Path(root) / PARTS / name, f"not a readable Arrow IPC file ({e})") from None


def write_json(path: Path, obj: Any) -> None:
    atomic_write(path, json.dumps(obj, indent=2, sort_keys=True).encode())


def finalize(root: Path, fingerprint: Fingerprint, parts: Sequence[dict[str, Any]],
             build: dict[str, Any] | None = None, *, key: bytes | None = None) -> Manifest:
    """Index the given parts (in part-id order), then write ``index.arrow``, ``manifest.hmac``
    (with a key) and, last, ``manifest.json``.

    Args:
        root: cache directory.
        fingerprint: what the values depend on.
        parts: part records (``name`` relative to ``parts/``, ``bytes``, ``blake2b``).
        build: build settings recorded in the manifest.
        key: MAC key (see :mod:`.mac`); ``None`` writes no MAC and removes a stale one.

    A manifest already in ``root`` is removed first: a crash between the index and the new
    manifest leaves an unfinished build (rerun the merge), never an index that disagrees with
    its manifest.

    Raises:
        ValueError: parts disagree on value dtype or entropy, or a key appears twice with
            different values.
        RefCacheCorruptError: a part name is not ``rank-NNNNN/part-NNNNNN.arrow``, a part is
            unreadable, a symbolic link, or its size differs from its record.
        RefCacheWriteError: the index or manifest cannot be written.
    """
    root = Path(root)
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("key_hi", "key_lo", "part", "offset", "length",
                                                          "logp_crc", "entropy_crc")}
    value_dtype, has_entropy = None, None
    for pid, rec in enumerate(parts):
        path = root / PARTS / check_part_name(rec["name"], root / PARTS)
        whole = _map_regular(root, f"{PARTS}/{rec['name']}")
        if whole.size != rec["bytes"]:
            raise RefCacheCorruptError(path, f"is {whole.size} bytes, its build recorded {rec['bytes']}")
        try:
            t = pa.ipc.open_file(pa.BufferReader(whole)).read_all()
        except (pa.ArrowException, OSError) as e:
            raise RefCacheCorruptError(path, f"not a readable Arrow IPC file ({e})") from None
        logp = _column(t, "logp")
        vd, he = np.dtype(logp.type.value_type.to_pandas_dtype()).name, "entropy" in t.column_names
        if value_dtype is None:
            value_dtype, has_entropy = vd, he
        elif (vd, he) != (value_dtype, has_entropy):
            raise ValueError(f"part {rec['name']} stores {vd} (entropy={he}); earlier parts store "
                             f"{value_dtype} (entropy={has_entropy})")
        n = t.num_rows
        for k in ("key_hi", "key_lo", "length", "logp_crc", "entropy_crc"):
            cols[k].append(_column(t, k).to_numpy())
        cols["part"].append(np.full(n, pid, np.int32))
        cols["offset"].append(logp.offsets.to_numpy()[:-1].astype(np.int64))
    arrays = {k: np.concatenate(v) if v else np.zeros(0) for k, v in cols.items()}
    order = np.lexsort((arrays["key_lo"], arrays["key_hi"]))
    arrays = {k: v[order] for k, v in arrays.items()}
    dup = (arrays["key_hi"][1:] == arrays["key_hi"][:-1]) & (arrays["key_lo"][1:] == arrays["key_lo"][:-1])
    if dup.any():
        same = (arrays["logp_crc"][1:] == arrays["logp_crc"][:-1]) & (arrays["length"][1:] == arrays["length"][:-1])
        if not same[dup].all():
            raise ValueError("a sequence key appears in two parts with different values")
        keep = np.concatenate([[True], ~dup])
        arrays = {k: v[keep] for k, v in arrays.items()}
    manifest = Manifest(
        fingerprint=fingerprint, value_dtype=value_dtype or "float32", has_entropy=bool(has_entropy),
        num_sequences=len(arrays["key_hi"]), num_tokens=int(arrays["length"].sum()) if len(order) else 0,
        files={}, parts=[f"{PARTS}/{r['name']}" for r in parts], values_at=[r["values_at"] for r in parts],
        build=dict(build or {}),
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    index = pa.table({f.name: pa.array(arrays[f.name], type=f.type) for f in _INDEX_SCHEMA},
                     schema=_INDEX_SCHEMA.with_metadata({"binding": manifest.binding()}))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, index.schema) as w:
        w.write_table(index)
    buf = sink.getvalue()
    (root / MANIFEST).unlink(missing_ok=True)
    atomic_write(root / INDEX, buf)
    manifest.files = {INDEX: {"bytes": buf.size, "blake2b": buffer_digest(buf)}}
    for rec in parts:
        manifest.files[f"{PARTS}/{rec['name']}"] = {"bytes": rec["bytes"], "blake2b": rec["blake2b"]}
    body = manifest.to_json().encode()
    if key is None:
        (root / MAC_FILE).unlink(missing_ok=True)
    else:
        atomic_write(root / MAC_FILE, mac_bytes(key, body))
    atomic_write(root / MANIFEST, body)
    return manifest


# --- reading -----------------------------------------------------------------------------

class Store:
    """Read side of a finished cache directory: memory-mapped index and parts.

    Opening reads the manifest (bounded, validated: types, ranges, file names), checks every
    listed file is a regular file inside the directory of its recorded size, the index's
    blake2b and its stamp of the manifest's binding, and the index's own consistency (schema,
    counts, sorted keys, every row inside its part). Part files are opened lazily. RAM use does
    not grow with the cache size: only the pages of rows actually served are touched.

    Args:
        root: the cache directory.
        full_verify: rehash every file (else the index only; rows are checked as served).
        key: MAC key held by the caller (see :mod:`.mac`), checked before the manifest is parsed.
        check_mac: ``False`` skips the MAC check (``info`` only displays a manifest).

    Raises (on construction):
        RefCacheCorruptError: missing/unparsable/invalid manifest, a missing, resized or
            non-regular file, an index that fails its checksum, stamp or consistency checks,
            a MAC that does not match.
        RefCacheMismatchError: a manifest of another format version; a MAC without a key, a
            key without a MAC, or a MAC made with another key.
    """

    def __init__(self, root: str | Path, *, full_verify: bool = False, key: bytes | None = None,
                 check_mac: bool = True) -> None:
        self._fds: dict[int, int] = {}
        self.root = Path(root)
        if not (self.root / MANIFEST).is_file():
            raise RefCacheCorruptError(self.root / MANIFEST,
                                       "no manifest (not a cache directory, or its build did not finish)",
                                       "If a build was interrupted, rerun it with the same arguments: it resumes "
                                       "after the last complete part")
        data = read_bounded(self.root, MANIFEST)
        if check_mac:
            _check_mac(self.root, key, data)
        self.manifest = Manifest.from_json(data, self.root / MANIFEST)
        for name in self.manifest.files:
            os.close(self._open(name))
        if full_verify:
            self.verify()
        else:
            self._check_digest(INDEX)
        self._read_index()
        self.value_dtype = np.dtype(self.manifest.value_dtype)

    def _open(self, name: str) -> int:
        """fd of a listed file, after checking it is regular, inside the root, of its recorded size."""
        fd, size = open_regular(self.root, name)
        want = self.manifest.files[name]["bytes"]
        if size != want:
            os.close(fd)
            raise RefCacheCorruptError(self.root / name, f"is {size} bytes, the manifest records {want} "
                                                         "(truncated, extended or replaced)")
        return fd

    def _check_digest(self, name: str) -> None:
        fd = self._open(name)
        try:
            ok = digest_fd(fd, self.manifest.files[name]["bytes"]) == self.manifest.files[name]["blake2b"]
        except OSError as e:  # EIO from a failing disk
            raise RefCacheCorruptError(self.root / name, f"cannot be read ({e.strerror or e})") from None
        finally:
            os.close(fd)
        if not ok:
            raise RefCacheCorruptError(self.root / name, "blake2b checksum mismatch")

    def _read_index(self) -> None:
        path, m = self.root / INDEX, self.manifest
        fd = self._open(INDEX)
        try:
            self._index_map = mmap.mmap(fd, m.files[INDEX]["bytes"], prot=mmap.PROT_READ)
            t = pa.ipc.open_file(pa.BufferReader(pa.py_buffer(self._index_map))).read_all()
        except (pa.ArrowException, OSError, ValueError) as e:
            raise RefCacheCorruptError(path, f"not a readable Arrow IPC file ({e})") from None
        finally:
            os.close(fd)

        def need(ok: object, what: str) -> None:
            if not ok:
                raise RefCacheCorruptError(path, what)

        need(t.schema.remove_metadata().equals(_INDEX_SCHEMA), f"unexpected columns {t.schema.names}")
        need((t.schema.metadata or {}).get(b"binding") == m.binding().encode(),
             "its stamp does not match the manifest (the manifest was edited after the cache was built)")
        need(all(c.null_count == 0 for c in t.columns), "null entries")
        need(t.num_rows == m.num_sequences, f"{t.num_rows} rows, the manifest records {m.num_sequences} sequences")
        cols = {name: _column(t, name).to_numpy() for name in _INDEX_SCHEMA.names}
        part, offset, length = cols["part"], cols["offset"], cols["length"]
        need(int(length.sum(dtype=np.int64)) == m.num_tokens, f"the manifest records {m.num_tokens} tokens")
        need(((part >= 0) & (part < len(m.parts))).all() and (offset >= 0).all() and (length >= 0).all(),
             "a row names a part that does not exist or a negative offset/length")
        item = np.dtype(m.value_dtype).itemsize
        for what in ("logp", "entropy") if m.has_entropy else ("logp",):
            # values that fit after the column's start; compared before any product, which could wrap in int64
            room = np.array([(m.files[p]["bytes"] - a[what]) // item for p, a in zip(m.parts, m.values_at,
                                                                                      strict=True)] or [0], np.int64)
            need(((offset <= room[part]) & (length <= room[part] - offset)).all(),
                 f"a {what} row lies outside its part")
        hi, lo = cols["key_hi"], cols["key_lo"]
        need(((hi[1:] > hi[:-1]) | ((hi[1:] == hi[:-1]) & (lo[1:] > lo[:-1]))).all(), "keys are not sorted")
        self.key_hi, self.key_lo, self.part, self.offset, self.length = hi, lo, part, offset, length
        self.crc = {"logp": cols["logp_crc"], "entropy": cols["entropy_crc"]}

    def verify(self) -> None:
        """Rehash every file against the manifest (regular files inside the directory only,
        reading no more than each file's recorded size).

        Raises:
            RefCacheCorruptError: the first file whose size or checksum differs.
        """
        for name in self.manifest.files:
            self._check_digest(name)

    def __len__(self) -> int:
        return int(self.key_hi.shape[0])

    def find(self, keys: Sequence[bytes]) -> np.ndarray:
        """Index rows of ``keys`` (``[n]`` int64), ``-1`` where absent."""
        if not keys:
            return np.zeros(0, np.int64)
        words = np.array([key_words(k) for k in keys], dtype=np.uint64).reshape(-1, 2)
        hi, lo = words[:, 0], words[:, 1]
        pos = np.searchsorted(self.key_hi, hi, side="left")
        n = len(self)
        safe = np.minimum(pos, max(n - 1, 0))
        hit = (pos < n) & (self.key_hi[safe] == hi) & (self.key_lo[safe] == lo) if n else np.zeros(len(hi), bool)
        rows = np.where(hit, pos, -1).astype(np.int64)
        for i in np.flatnonzero(~hit & (pos < n) & (self.key_hi[safe] == hi)):  # rare: equal high words
            j = int(pos[i])
            while j < n and self.key_hi[j] == hi[i]:
                if self.key_lo[j] == lo[i]:
                    rows[i] = j
                    break
                j += 1
        return rows

    def _fd(self, pid: int) -> int:
        fd = self._fds.get(pid)
        if fd is None:
            fd = self._fds[pid] = self._open(self.manifest.parts[pid])
        return fd

    def gather(self, rows: np.ndarray, what: str = "logp") -> np.ndarray:
        """The values of ``rows`` concatenated (``[Σ length]``), each row verified.

        Rows are read with positioned reads (``os.pread``) at offsets recorded in the
        manifest, so they pass through the page cache without entering this process's
        resident set; parts are never parsed at serving time.

        Raises:
            RefCacheCorruptError: a row fails its checksum or lies outside its part, or holds a
                value no model computes (a log-prob that is not finite and <= 0, an entropy
                outside ``[0, log V]``).
        """
        item = self.value_dtype.itemsize
        out = np.empty(int(self.length[rows].sum()), self.value_dtype)
        view = memoryview(out).cast("B")
        crc = self.crc[what]
        at = 0
        for r in rows.tolist():
            pid, off, n = int(self.part[r]), int(self.offset[r]), int(self.length[r])
            base = self.manifest.values_at[pid][what]
            try:
                got = os.preadv(self._fd(pid), [view[at * item:(at + n) * item]], base + off * item)
            except OSError as e:  # EIO from a failing disk
                raise RefCacheCorruptError(self.root / self.manifest.parts[pid], f"cannot be read ({e})") from None
            if got != n * item or row_checksum(out[at:at + n]) != int(crc[r]):
                raise RefCacheCorruptError(self.root / self.manifest.parts[pid],
                                           f"row at value offset {off} (length {n}) fails its checksum")
            at += n
        self._check_values(out, rows, what)
        return out

    def _check_values(self, out: np.ndarray, rows: np.ndarray, what: str) -> None:
        """Refuse values no model computes: a log-prob must be finite and <= 0 (up to
        ``LOGP_SLACK``), an entropy finite and within ``[0, log V]``; ``NaN`` marks a position
        not computed at build (reported by the caller when it is asked for)."""
        if what == "logp":
            ok = (out <= LOGP_SLACK) & (out > -np.inf)
        else:
            ok = (out >= -LOGP_SLACK) & (out <= math.log(self.manifest.fingerprint.vocab_size) + LOGP_SLACK)
        bad = ~ok & ~np.isnan(out)
        if not bad.any():
            return
        at = int(np.flatnonzero(bad)[0])
        ends = np.cumsum(self.length[rows])
        i = int(np.searchsorted(ends, at, side="right"))
        r = int(rows[i])
        pos = at - (int(ends[i - 1]) if i else 0)
        what_is = ("a log-prob must be finite and <= 0" if what == "logp"
                   else "an entropy must be finite and within [0, log V]")
        raise RefCacheCorruptError(self.root / self.manifest.parts[int(self.part[r])],
                                   f"row at value offset {int(self.offset[r])} holds {what} {float(out[at])!r} at "
                                   f"position {pos}; {what_is} (the cache was forged or miscomputed)")

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self) -> None:
        self.close()


def manifest_summary(m: Manifest) -> dict[str, Any]:
    """Plain-dict view of a manifest for ``info`` output."""
    d = asdict(m)
    d["total_bytes"] = sum(f["bytes"] for f in m.files.values())
    return d
