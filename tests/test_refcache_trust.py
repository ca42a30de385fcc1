"""Reference cache against a forger and a careless user (issue 33): a finished cache is never
relabelled by a merge, a keyed cache refuses tampering and the wrong key, values no model
computes are never served, builds never write through planted links, and bad arguments get
named errors. The model is the float64 toy of ``test_refcache_faults`` (milliseconds a build)."""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from logitless.cli import main
from logitless.refcache import (
    RefCache,
    RefCacheCorruptError,
    RefCacheError,
    RefCacheMismatchError,
    ReferenceModel,
    build,
    finalize,
    merge,
    sequence_key,
)
from logitless.refcache.files import buffer_digest
from logitless.refcache.fingerprint import Fingerprint
from logitless.refcache.store import row_checksum

sys.path.insert(0, str(Path(__file__).parent))
from test_refcache_faults import V, _Toy, _Vocab, assert_named, opts, oracle, padded, records, rewrite_manifest, toy

STATE = "parts/rank-00000/state.json"


def cache_bytes(root: Path) -> dict[str, bytes]:
    """Every file of the cache directory (bookkeeping included, locks excluded)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.endswith(".lock")}


def served(root: Path, recs: list[list[int]], **open_kw) -> torch.Tensor:
    ids, mask = padded(recs)
    with RefCache.open(root, **open_kw) as cache:
        return cache.lookup(ids, mask)


def assert_exact(got: torch.Tensor, ref: ReferenceModel, recs: list[list[int]], temperature: float = 1.0) -> None:
    for i, s in enumerate(recs):
        assert (got[i, 1:len(s)] - oracle(ref, s, temperature)).abs().max() < 1e-12


# --- forging with the library's own helpers ----------------------------------------------------

def restamp_index(root: Path, edit) -> None:
    """Apply ``edit`` to the index's columns (a dict of numpy arrays) and rewrite the index with
    its stamp kept, then the manifest's record of it and the manifest checksum: a forgery that
    every checksum vouches for."""
    t = pa.ipc.open_file(pa.BufferReader((root / "index.arrow").read_bytes())).read_all()
    cols = {n: t.column(n).to_numpy().copy() for n in t.column_names}
    edit(cols)
    new = pa.table({f.name: pa.array(cols[f.name], type=f.type) for f in t.schema}, schema=t.schema)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, new.schema) as w:
        w.write_table(new)
    buf = sink.getvalue().to_pybytes()
    (root / "index.arrow").write_bytes(buf)
    rewrite_manifest(root, lambda b: {**b, "files": {**b["files"], "index.arrow": {"bytes": len(buf),
                                                                                   "blake2b": buffer_digest(buf)}}})


def rewrite_row(root: Path, key: bytes, change) -> None:
    """Replace the stored log-probs of the sequence ``key`` by ``change(values)`` in its part,
    and re-stamp every checksum on the way (row, index, part, manifest)."""
    m = json.loads((root / "manifest.json").read_text())
    t = pa.ipc.open_file(pa.BufferReader((root / "index.arrow").read_bytes())).read_all()
    hi, lo = np.frombuffer(key, ">u8")
    r = int(np.flatnonzero((t.column("key_hi").to_numpy() == hi) & (t.column("key_lo").to_numpy() == lo))[0])
    pid, off, n = (int(t.column(c)[r].as_py()) for c in ("part", "offset", "length"))
    name = m["parts"][pid]
    data = bytearray((root / name).read_bytes())
    item = np.dtype(m["value_dtype"]).itemsize
    at = m["values_at"][pid]["logp"] + off * item
    row = change(np.frombuffer(bytes(data[at:at + n * item]), m["value_dtype"]).copy())
    data[at:at + n * item] = row.tobytes()
    (root / name).write_bytes(bytes(data))

    def new_crc(cols):
        cols["logp_crc"][r] = row_checksum(row)

    restamp_index(root, new_crc)
    rewrite_manifest(root, lambda b: {**b, "files": {**b["files"], name: {"bytes": len(data),
                                                                          "blake2b": buffer_digest(bytes(data))}}})


@pytest.fixture
def keyed(tmp_path, seed):
    """A cache built with a key file, its key, model and records."""
    key = tmp_path / "key"
    key.write_text(os.urandom(32).hex() + "\n")
    ref, recs = toy(seed), records(6, seed)
    root = tmp_path / "c"
    build(ref, recs, root, options=opts(key_file=key))
    return {"root": root, "key": key, "ref": ref, "recs": recs}


# --- item 1: relabelling through state.json + merge ----------------------------------------------

def _relabel(field: str, seed: int):
    if field == "temperature":
        return lambda fp: {**fp, "temperature": 0.5}
    other = toy(seed + 1).fingerprint().model_weights  # model B's public weights fingerprint
    return lambda fp: {**fp, "model_weights": other}


@pytest.mark.parametrize("field", ["temperature", "model_weights"])
def test_merge_never_relabels_a_finished_cache(tmp_path, seed, field):
    """state.json edited to another temperature or model B's weights fingerprint, then merge (API
    and CLI): refused, and the cache is left byte for byte as it was, so open with model B (or the
    forged temperature) still refuses and open with the true model serves the true values. With
    the manifest and index deleted as well, the parts (which record their state.json's digest)
    do not merge under the edited one."""
    ref, recs = toy(seed), records(5, seed)
    root = tmp_path / "c"
    build(ref, recs, root, options=opts())
    state = json.loads((root / STATE).read_text())
    state["fingerprint"] = _relabel(field, seed)(state["fingerprint"])
    (root / STATE).write_text(json.dumps(state, indent=2, sort_keys=True))
    before = cache_bytes(root)
    with pytest.raises(RefCacheError) as e:
        merge(root)
    assert_named(e.value)
    assert main(["refcache", "merge", str(root)]) == 1
    assert cache_bytes(root) == before
    wrong = {"temperature": 0.5} if field == "temperature" else {"model": toy(seed + 1), "temperature": 1.0}
    with pytest.raises(RefCacheMismatchError) as e:
        RefCache.open(root, verify="full", **wrong)
    assert set(e.value.fields) == {field}
    assert_exact(served(root, recs, model=ref, temperature=1.0, verify="full"), ref, recs)

    (root / "manifest.json").unlink()
    (root / "index.arrow").unlink()
    with pytest.raises(RefCacheCorruptError, match="was not written under") as e:
        merge(root)
    assert_named(e.value)
    assert not (root / "manifest.json").exists()


def test_merge_refuses_a_finished_cache_its_bookkeeping_does_not_describe(tmp_path, seed):
    """A finished cache re-finalized under another fingerprint (manifest and index consistent):
    merge compares it with the bookkeeping, refuses naming the field, and rewrites nothing."""
    ref, recs = toy(seed), records(5, seed)
    root = tmp_path / "c"
    build(ref, recs, root, options=opts())
    before = cache_bytes(root)
    assert merge(root).num_sequences == len(set(map(tuple, recs)))  # described by its bookkeeping: a no-op
    assert cache_bytes(root) == before
    parts = json.loads((root / "parts/rank-00000/done.json").read_text())["parts"]
    fp = json.loads((root / "manifest.json").read_text())["fingerprint"]
    finalize(root, Fingerprint(**{**fp, "temperature": 0.5}), parts)
    before = cache_bytes(root)
    with pytest.raises(RefCacheMismatchError, match="merge never rewrites") as e:
        merge(root)
    assert "fingerprint.temperature" in e.value.fields
    assert cache_bytes(root) == before


# --- item 2: keyed MAC, served values checked -------------------------------------------------

def test_keyed_cache_needs_its_key(keyed, tmp_path, monkeypatch, capsys):
    root, key = keyed["root"], keyed["key"]
    assert (root / "manifest.hmac").stat().st_mode == (root / "manifest.json").stat().st_mode
    assert_exact(served(root, keyed["recs"], key_file=key, model=keyed["ref"], verify="full"), keyed["ref"],
                 keyed["recs"])
    monkeypatch.setenv("LOGITLESS_REFCACHE_KEY", key.read_text().strip())
    assert_exact(served(root, keyed["recs"]), keyed["ref"], keyed["recs"])  # the key from the environment
    monkeypatch.delenv("LOGITLESS_REFCACHE_KEY")
    with pytest.raises(RefCacheMismatchError, match="built with a key") as e:
        RefCache.open(root)
    assert set(e.value.fields) == {"mac"}
    other = tmp_path / "other-key"
    other.write_bytes(os.urandom(32))
    with pytest.raises(RefCacheMismatchError, match="another key") as e:
        RefCache.open(root, key_file=other)
    assert set(e.value.fields) == {"key_check"}
    short = tmp_path / "short-key"
    short.write_text("0123456789")
    with pytest.raises(ValueError, match=re.escape(f"key_file {short}: the key is 10 bytes; use at least 16")):
        RefCache.open(root, key_file=short)
    with pytest.raises(ValueError, match=r"key_file .*cannot read it"):
        RefCache.open(root, key_file=tmp_path / "no-such-key")
    monkeypatch.setenv("LOGITLESS_REFCACHE_KEY", "short")
    with pytest.raises(ValueError, match=r"\$LOGITLESS_REFCACHE_KEY: the key is 5 bytes"):
        RefCache.open(root)
    monkeypatch.delenv("LOGITLESS_REFCACHE_KEY")
    assert main(["refcache", "verify", str(root)]) == 1
    assert main(["refcache", "verify", str(root), "--key-file", str(key)]) == 0
    capsys.readouterr()
    assert main(["refcache", "info", str(root)]) == 0  # info displays, it does not check
    assert "HMAC-SHA256" in capsys.readouterr().out
    # merging or rebuilding a keyed cache without its key is refused as well; with it, a no-op
    before = cache_bytes(root)
    with pytest.raises(RefCacheMismatchError):
        merge(root)
    with pytest.raises(RefCacheMismatchError):
        build(keyed["ref"], keyed["recs"], root, options=opts())
    assert merge(root, key_file=key).num_sequences == len(keyed["recs"])
    build(keyed["ref"], keyed["recs"], root, options=opts(key_file=key))
    assert cache_bytes(root) == before


def _forge_manifest(root: Path) -> None:
    parts = json.loads((root / "parts/rank-00000/done.json").read_text())["parts"]
    fp = json.loads((root / "manifest.json").read_text())["fingerprint"]
    finalize(root, Fingerprint(**{**fp, "temperature": 0.5}), parts)  # removes the MAC it cannot make


def _raise_row(root: Path, recs: list[list[int]]) -> None:
    rewrite_row(root, sequence_key(recs[0]), lambda row: row + 1.0)


def _swap_rows(root: Path, recs: list[list[int]]) -> None:
    def swap(cols):
        for c in ("key_hi", "key_lo"):
            cols[c][[0, 1]] = cols[c][[1, 0]]  # keys stay sorted only if swapped with their order ...
        order = np.lexsort((cols["key_lo"], cols["key_hi"]))
        for c in cols:
            cols[c] = cols[c][order]  # ... so re-sort: each key now points at the other's row

    restamp_index(root, swap)


@pytest.mark.parametrize("forge", [_forge_manifest, _raise_row, _swap_rows])
@pytest.mark.parametrize("keep_mac", [True, False])
def test_tampering_with_a_keyed_cache_is_detected(keyed, forge, keep_mac):
    """Relabelled manifest (re-finalized by the library's own helper), a row raised by one nat,
    two rows swapped in the index, each with every checksum re-stamped: opened with the key, a
    named error, whether the old MAC file is left in place or removed."""
    root = keyed["root"]
    mac = (root / "manifest.hmac").read_bytes()
    forge(root, *([] if forge is _forge_manifest else [keyed["recs"]]))
    if keep_mac:
        (root / "manifest.hmac").write_bytes(mac)
    else:
        (root / "manifest.hmac").unlink(missing_ok=True)
    with pytest.raises(RefCacheError) as e:
        served(root, keyed["recs"], key_file=keyed["key"])
    assert_named(e.value)
    assert ("MAC does not match" in str(e.value)) if keep_mac else (set(e.value.fields) == {"mac"})


@pytest.mark.parametrize("value", [np.inf, -np.inf, 0.5, "raise"])
def test_values_no_model_computes_are_never_served(tmp_path, seed, value):
    """An unkeyed cache forged with every checksum re-stamped: a log-prob of +inf, -inf, +0.5, or
    a row raised by one nat until its largest value is above 0. The checksums vouch for it, the
    full verify passes; serving refuses it by name (finite and <= 0), and rows not touched are
    still served exactly."""
    ref, recs = toy(seed), records(5, seed)
    root = tmp_path / "c"
    build(ref, recs, root, options=opts(entropy=True))
    target = recs[int(np.argmax([len(s) for s in recs]))]
    pos = 1 + int(torch.randint(0, len(target) - 1, ()))

    def change(row):
        if value == "raise":
            return row + (1.0 - np.nanmax(row))  # the largest log-prob becomes +1 nat
        row[pos] = value
        return row

    rewrite_row(root, sequence_key(target), change)
    RefCache.open(root, verify="full").close()  # every checksum vouches for the forgery
    with pytest.raises(RefCacheCorruptError, match=r"holds logp .* a log-prob must be finite and <= 0") as e:
        served(root, [target])
    assert_named(e.value)
    rest = [s for s in recs if s != target]
    assert_exact(served(root, rest), ref, rest)
    with RefCache.open(root) as cache:  # entropy rows are untouched and still served
        ids, mask = padded(rest)
        assert torch.isfinite(cache.lookup(ids, mask, what="entropy")).all()


# --- item 3: planted links ---------------------------------------------------------------------

@pytest.mark.parametrize("link", ["parts", "parts/rank-00000"])
def test_build_refuses_planted_symlinks_before_touching_anything(tmp_path, seed, link):
    """parts/ or the rank directory a symlink to a foreign directory holding a .tmp file: build
    and merge refuse by name; the foreign directory and the cache directory are unchanged."""
    foreign = tmp_path / "foreign"
    (foreign / "rank-00000").mkdir(parents=True)
    for d in (foreign, foreign / "rank-00000"):
        (d / ".part-000000.arrow.x.tmp").write_bytes(os.urandom(16))
        (d / "keep.txt").write_bytes(os.urandom(16))
    root = tmp_path / "c"
    (root / link).parent.mkdir(parents=True, exist_ok=True)
    (root / link).symlink_to(foreign if link == "parts" else foreign / "rank-00000", target_is_directory=True)
    theirs, ours = cache_bytes(foreign), sorted(map(str, root.rglob("*")))
    with pytest.raises(RefCacheCorruptError, match="is a symbolic link") as e:
        build(toy(seed), records(4, seed), root, options=opts())
    assert_named(e.value)
    assert link in str(e.value)
    with pytest.raises(RefCacheCorruptError, match="is a symbolic link"):
        merge(root)
    assert cache_bytes(foreign) == theirs and sorted(map(str, root.rglob("*"))) == ours


# --- item 6: entropy into a finished cache -----------------------------------------------------

def test_entropy_build_into_a_cache_without_it_is_refused(tmp_path, seed):
    ref, recs = toy(seed), records(4, seed)
    root = tmp_path / "c"
    build(ref, recs, root, options=opts())
    before = cache_bytes(root)
    with pytest.raises(RefCacheMismatchError, match="already holds a finished cache of other content") as e:
        build(ref, recs, root, options=opts(entropy=True))
    assert set(e.value.fields) == {"entropy"} and e.value.fields["entropy"] == (False, True)
    assert cache_bytes(root) == before
    with RefCache.open(root) as cache, pytest.raises(ValueError, match="built without entropy"):
        cache.lookup(*padded(recs), what="entropy")


# --- item 7: index offsets beyond int64 --------------------------------------------------------

@pytest.mark.parametrize("offset", [2**60, 2**61, 2**62, 2**63 - 1])
def test_index_offset_that_wraps_int64_is_refused_on_open_and_verify(tmp_path, seed, offset):
    ref, recs = toy(seed), records(4, seed)
    root = tmp_path / "c"
    build(ref, recs, root, options=opts())

    def far(cols):
        cols["offset"][int(torch.randint(0, len(cols["offset"]), ()))] = offset

    restamp_index(root, far)
    for verify in ("fast", "full"):
        with pytest.raises(RefCacheCorruptError, match="row lies outside its part") as e:
            RefCache.open(root, verify=verify)
        assert_named(e.value)
    assert main(["refcache", "verify", str(root)]) == 1


# --- item 13: permissions ----------------------------------------------------------------------

@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_cache_files_follow_the_umask(tmp_path, seed, umask):
    """Every file and directory of a build is created as any new file is under the umask (the
    MAC file too: `test_keyed_cache_needs_its_key`)."""
    old = os.umask(umask)
    try:
        root = tmp_path / "c"
        build(toy(seed), records(4, seed), root, options=opts())
    finally:
        os.umask(old)
    files = [p for p in root.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"manifest.json", "index.arrow", "state.json", "done.json", "build.lock",
                                       "merge.lock", "part-000000.arrow"}
    modes = {str(p.relative_to(root)): oct(p.stat().st_mode & 0o777) for p in files}
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes
    assert {oct(p.stat().st_mode & 0o777) for p in [root, *root.rglob("*")] if p.is_dir()} == {oct(0o777 & ~umask)}


# --- item 10: named errors ---------------------------------------------------------------------

def test_tokenizer_path_is_a_named_type_error(tmp_path, seed):
    ref, recs = toy(seed), records(3, seed)
    root = tmp_path / "c"
    named = r"tokenizer must be a tokenizer object with get_vocab\(\).*AutoTokenizer.from_pretrained"
    with pytest.raises(TypeError, match=named):
        build(ref, recs, root, tokenizer=str(tmp_path), options=opts())
    assert not root.exists()
    build(ref, recs, root, tokenizer=_Vocab(V), options=opts())
    with pytest.raises(TypeError, match=named):
        RefCache.open(root, tokenizer=tmp_path)


def test_two_dimensional_records_are_refused(tmp_path, seed):
    ref = toy(seed)
    ids = torch.randint(0, V, (2, 5))
    for rec, name in [(ids.tolist(), "token ids"), (ids[:1], "token ids"), ({"input_ids": ids[:1]}, "input_ids"),
                      ({"input_ids": ids[0], "loss_mask": torch.ones(1, 5)}, "loss_mask"),
                      ({"prompt_ids": ids[0], "completion_ids": ids[1:]}, "completion_ids"),
                      ({"input_ids": ids[0], "attention_mask": np.ones((5, 1))}, "attention_mask")]:
        with pytest.raises(ValueError, match=rf"record 1: {name} must be one sequence \(1-D\), got shape"):
            build(ref, [ids[0].tolist(), rec], tmp_path / "c", options=opts())
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("big", [2**63, 2**63 + 12345, 2**64 - 1, 2**64])
def test_token_ids_beyond_int64_are_reported_as_they_are(tmp_path, seed, big):
    ref, recs = toy(seed), records(3, seed)
    pos = int(torch.randint(0, len(recs[2]), ()))
    bad = list(recs[2])
    bad[pos] = big
    forms = [bad]
    if big < 2**64:
        forms.append(np.array(bad, dtype=np.uint64))
    for form in forms:
        with pytest.raises(ValueError, match=rf"record 2: token ids holds token id {big} at position {pos}"):
            build(ref, [*recs[:2], form], tmp_path / "c", options=opts())
    if big < 2**64:
        with pytest.raises(ValueError, match=f"token id {big} is larger than any vocabulary"):
            sequence_key(np.array(bad, dtype=np.uint64))
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("raw", ["4GiB", "-1", "1e9", ""])
def test_bad_full_hash_bytes_variable_is_named(tmp_path, seed, monkeypatch, raw):
    monkeypatch.setenv("LOGITLESS_REFCACHE_FULL_HASH_BYTES", raw)
    with pytest.raises(ValueError, match=rf"LOGITLESS_REFCACHE_FULL_HASH_BYTES must be a whole number of bytes "
                                         rf">= 0 .*got {raw!r}"):
        build(toy(seed), records(2, seed), tmp_path / "c", options=opts())
    monkeypatch.setenv("LOGITLESS_REFCACHE_FULL_HASH_BYTES", "0")  # a valid value: everything sampled
    build(toy(seed), records(2, seed), tmp_path / "c", options=opts())


def test_ctrl_c_of_a_cli_build_exits_130_and_resumes(tmp_path, seed, monkeypatch, capsys):
    """KeyboardInterrupt in the third batch of `logitless refcache build`: exit status 130, one
    line on stderr and no traceback; rerunning the command resumes after the two parts written
    and gives the files of an uninterrupted build."""
    from tiny_models import save_tiny_qwen2

    build_module = importlib.import_module("logitless.refcache.build")  # the package's `build` is the function

    model = save_tiny_qwen2(tmp_path / "m", vocab_size=32, hidden_size=16, seed=seed % 1000)
    g = torch.Generator().manual_seed(seed)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(torch.randint(0, 29, (int(n),), generator=g).tolist()) + "\n"
                            for n in torch.randint(2, 9, (5,), generator=g)))
    argv = ["refcache", "build", "--model", str(model), "--data", str(data), "--batch-size", "1",
            "--part-bytes", "1", "--no-progress", "--dtype", "float64"]
    real, calls = build_module.batch_logprobs, [0]

    def interrupted(*args, **kw):
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(build_module, "batch_logprobs", interrupted)
    try:
        rc = main([*argv, "--out", str(tmp_path / "c")])
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped the CLI (a traceback for the user)")
    err = capsys.readouterr().err
    ours = [line for line in err.splitlines() if line.startswith("logitless refcache build:")]
    assert rc == 130 and "Traceback" not in err and len(ours) == 1 and "interrupted" in ours[0], err
    assert len(list((tmp_path / "c").rglob("part-*.arrow"))) == 2 and not list((tmp_path / "c").rglob("*.tmp"))
    monkeypatch.setattr(build_module, "batch_logprobs", real)
    assert main([*argv, "--out", str(tmp_path / "c")]) == 0
    assert "resumed at batch 2/5" in capsys.readouterr().out
    assert main([*argv, "--out", str(tmp_path / "one")]) == 0
    one = cache_bytes(tmp_path / "one")
    resumed = cache_bytes(tmp_path / "c")
    for b in (one, resumed):
        body = json.loads(b.pop("manifest.json"))
        body.pop("created_at"), body.pop("checksum")
        b["manifest"] = json.dumps(body, sort_keys=True).encode()
    assert resumed == one


# --- item 14: every transform field is compared ------------------------------------------------

_TRANSFORM = {"temperature": 0.9, "logit_scale": 0.7, "softcap": 20.0}
_OTHER = {"temperature": 1.1, "logit_scale": 1.3, "softcap": None}


def _toy_with(seed: int, logit_scale: float, softcap: float | None) -> ReferenceModel:
    m = _Toy(seed)
    return ReferenceModel(hidden_fn=m.hidden, weight=m.head, logit_scale=logit_scale, softcap=softcap, module=m)


@pytest.mark.parametrize("field", sorted(_TRANSFORM))
@pytest.mark.parametrize("other", ["other", "close"])
def test_each_transform_field_is_compared(tmp_path, seed, field, other):
    """A cache built under temperature 0.9, logit_scale 0.7, softcap 20: opening with a model
    (or temperature) that differs in exactly one of them — changed or by one ulp — is refused
    naming that field only; building into it or resuming a partial build of it is too."""
    base = dict(_TRANSFORM)
    changed = dict(base)
    value = base[field]
    changed[field] = _OTHER[field] if other == "other" else float(np.nextafter(value, np.inf))
    ref = _toy_with(seed, base["logit_scale"], base["softcap"])
    recs = records(4, seed)
    root = tmp_path / "c"
    build(ref, recs, root, tokenizer=_Vocab(V), options=opts(temperature=base["temperature"]))
    RefCache.open(root, model=ref, tokenizer=_Vocab(V), temperature=base["temperature"]).close()
    theirs = _toy_with(seed, changed["logit_scale"], changed["softcap"])
    with pytest.raises(RefCacheMismatchError) as e:
        RefCache.open(root, model=theirs, tokenizer=_Vocab(V), temperature=changed["temperature"])
    assert set(e.value.fields) == {field}
    assert e.value.fields[field] == (base[field], changed[field])
    with pytest.raises(RefCacheMismatchError) as e:
        build(theirs, recs, root, tokenizer=_Vocab(V), options=opts(temperature=changed["temperature"]))
    assert set(e.value.fields) == {field}

    partial = tmp_path / "p"
    with pytest.raises(KeyboardInterrupt):
        build(ref, recs, partial, options=opts(batch_size=1, temperature=base["temperature"]),
              on_batch=_interrupt_at(1))
    with pytest.raises(RefCacheMismatchError) as e:
        build(theirs, recs, partial, options=opts(batch_size=1, temperature=changed["temperature"]))
    assert set(e.value.fields) == {field}


def _interrupt_at(n: int):
    def stop(done: int, total: int) -> None:
        if done == n:
            raise KeyboardInterrupt
    return stop


def test_a_partial_build_of_an_older_library_version_resumes_and_merges(tmp_path, seed, monkeypatch):
    """Guard for the state binding: a resumed build keeps the state.json on disk (written by
    another library version) and binds its new parts to it, so the merge accepts the result."""
    import logitless.refcache.model as model_module

    ref, recs = toy(seed), records(5, seed)
    root = tmp_path / "c"
    monkeypatch.setattr(model_module, "__version__", "0.0.older")
    with pytest.raises(KeyboardInterrupt):
        build(ref, recs, root, options=opts(batch_size=1), on_batch=_interrupt_at(2))
    monkeypatch.undo()
    res = build(ref, recs, root, options=opts(batch_size=1))
    assert res.resumed_at == 2 and res.manifest.fingerprint.library_version == "0.0.older"
    assert_exact(served(root, recs, model=ref, temperature=1.0, verify="full"), ref, recs)
