"""Reference cache under faults: crafted manifests, corruption of every file, crashes, two
builders, a read-only or full disk, bad inputs. Every fault ends in a named error that says
what to do, or in exactly the values an intact cache serves; never a wrong value, a raw
``OSError``/``KeyError``/``UnicodeDecodeError``, a read outside the cache directory, or a hang.

The model is a float64 toy (embedding prefix sums through ``tanh``, then a linear head) run
through :class:`ReferenceModel`, so builds take milliseconds and the oracle is an explicit
``log_softmax`` in float64. Byte flips are sampled per run (fresh seed, printed on failure);
``LOGITLESS_FULL_FAULTS=1`` flips every byte of every file.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from logitless.refcache import (
    BuildOptions,
    RefCache,
    RefCacheCorruptError,
    RefCacheError,
    RefCacheLockedError,
    RefCacheMismatchError,
    RefCacheMissError,
    RefCacheWriteError,
    ReferenceModel,
    build,
    finalize,
    merge,
)
from logitless.refcache import files as cache_files
from logitless.refcache.fingerprint import Fingerprint, _json_checksum

V, H = 50, 16
FULL = os.environ.get("LOGITLESS_FULL_FAULTS") == "1"
PART = "parts/rank-00000/part-000000.arrow"


class _Toy(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Parameter(torch.randn(V, H, generator=g, dtype=torch.float64) / 2)
        self.head = torch.nn.Parameter(torch.randn(V, H, generator=g, dtype=torch.float64))

    def hidden(self, ids: torch.Tensor, _attn: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.emb[ids].cumsum(1))  # causal: position t sees tokens <= t only


def toy(seed: int = 0) -> ReferenceModel:
    m = _Toy(seed)
    return ReferenceModel(hidden_fn=m.hidden, weight=m.head, module=m)


def oracle(ref: ReferenceModel, seq: list[int], temperature: float = 1.0) -> torch.Tensor:
    """``log p(x[t] | x[:t])`` for ``t >= 1`` from materialized float64 logits."""
    with torch.no_grad():
        z = ref.hidden_fn(torch.tensor([seq]), None)[0, :-1] @ ref.weight.T / temperature
    return z.log_softmax(-1).gather(1, torch.tensor(seq[1:])[:, None])[:, 0]


def records(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (int(L),), generator=g).tolist() for L in torch.randint(2, 12, (n,), generator=g)]


def opts(**kw) -> BuildOptions:
    return BuildOptions(progress=False, **{"batch_size": 2, "part_bytes": 1, **kw})


def padded(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(map(len, seqs))
    ids, mask = torch.zeros(len(seqs), T, dtype=torch.long), torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), 1
    return ids, mask


def cache_files_of(root: Path) -> list[Path]:
    m = json.loads((root / "manifest.json").read_text())
    return [root / "manifest.json", *(root / n for n in sorted(m["files"]))]


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file of a cache directory (bookkeeping included) except the manifest's timestamp."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.name.endswith(".lock"):
            data = p.read_bytes()
            if p.name == "manifest.json":
                body = json.loads(data)
                body.pop("created_at"), body.pop("checksum")
                data = json.dumps(body, sort_keys=True).encode()
            out[str(p.relative_to(root))] = data
    return out


def rewrite_manifest(root: Path, edit) -> None:
    """Apply ``edit`` to the parsed manifest and recompute its checksum, as a hand edit would."""
    body = json.loads((root / "manifest.json").read_text())
    body.pop("checksum")
    write_manifest(root, edit(body))


def write_manifest(root: Path, body: object) -> None:
    """``body`` as the manifest, with a valid checksum where it is an object, in the library's
    own layout (so the edit reaches the field checks, not only the layout check)."""
    if isinstance(body, dict):
        body = {**body, "checksum": _json_checksum(body)}
    (root / "manifest.json").write_text(json.dumps(body, indent=2, sort_keys=True))


def assert_named(err: BaseException) -> None:
    assert isinstance(err, RefCacheError), f"{type(err).__name__}: {err}"
    if isinstance(err, RefCacheCorruptError):  # ends with what to do
        advice = str(err).split(f"{err.reason}. ", 1)[1]
        assert advice.startswith(("Rebuild the cache", "If a build was interrupted, rerun", "Delete ")), advice


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A finished cache (logp + entropy, 4 parts) and what it must serve."""
    root = tmp_path_factory.mktemp("built") / "c"
    ref, recs = toy(), records(7, seed=1)
    build(ref, recs, root, options=opts(entropy=True))
    ids, mask = padded(recs)
    cache = RefCache.open(root, model=ref, temperature=1.0)
    want = cache.lookup(ids, mask), cache.lookup(ids, mask, what="entropy")
    for i, s in enumerate(recs):  # the intact cache against the float64 oracle
        assert (want[0][i, 1:len(s)] - oracle(ref, s)).abs().max() < 1e-12
    cache.close()
    return {"root": root, "ref": ref, "recs": recs, "ids": ids, "mask": mask, "want": want}


@pytest.fixture
def cache_copy(built, tmp_path):
    dst = tmp_path / "c"
    shutil.copytree(built["root"], dst)
    return dst


def serve_or_raise(root: Path, built: dict) -> str:
    """Open fast and serve everything: ``"served"`` if exactly the intact values came back,
    ``"refused"`` on a named error; anything else fails the test."""
    try:
        with RefCache.open(root) as cache:
            got = (cache.lookup(built["ids"], built["mask"]), cache.lookup(built["ids"], built["mask"], what="entropy"))
    except RefCacheError as e:
        assert_named(e)
        return "refused"
    assert torch.equal(got[0], built["want"][0]) and torch.equal(got[1], built["want"][1]), "wrong values served"
    return "served"


def verify_refuses(root: Path) -> RefCacheError:
    with pytest.raises(RefCacheError) as e:
        RefCache.open(root, verify="full")
    assert_named(e.value)
    return e.value


# --- security ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["../outside.arrow", "/tmp/outside.arrow", "/proc/self/pagemap", "/dev/zero",
                                  "parts/../../outside.arrow", "parts/rank-00000/../../../outside.arrow",
                                  "parts/rank-00000/part-000000.arrow/..", "./index.arrow", "parts//x.arrow",
                                  "manifest.json", "parts/rank-00000/part-000000.arrow\x00", ""])
def test_manifest_may_name_only_cache_files_inside_the_directory(cache_copy, name):
    """A manifest edited to point a part at another path (checksum recomputed, a byte-identical
    copy of the part placed there, so following the path would serve correct-looking data)
    is refused by open, lookup and verify before anything outside is opened."""
    outside = cache_copy.parent / "outside.arrow"
    shutil.copy(cache_copy / PART, outside)

    def point_elsewhere(body):
        body["files"][name] = body["files"].pop(PART)
        body["parts"][0] = name
        return body

    rewrite_manifest(cache_copy, point_elsewhere)
    for call in (lambda: RefCache.open(cache_copy), lambda: RefCache.open(cache_copy, verify="full")):
        with pytest.raises(RefCacheCorruptError, match="not a cache file name") as e:
            call()
        assert_named(e.value)
    from logitless.cli import main
    assert main(["refcache", "verify", str(cache_copy)]) == 1


def _make_symlink_to_copy(root: Path) -> None:
    (root.parent / "copy.arrow").write_bytes((root / PART).read_bytes())
    (root / PART).unlink()
    (root / PART).symlink_to(root.parent / "copy.arrow")


def _make_symlinked_rank_dir(root: Path) -> None:
    shutil.move(root / "parts" / "rank-00000", root.parent / "rank-copy")
    (root / "parts" / "rank-00000").symlink_to(root.parent / "rank-copy", target_is_directory=True)


def _make_fifo(root: Path) -> None:
    (root / PART).unlink()
    os.mkfifo(root / PART)


def _make_device_link(root: Path) -> None:
    (root / PART).unlink()
    (root / PART).symlink_to("/dev/zero")


def _make_proc_link(root: Path) -> None:
    (root / PART).unlink()
    (root / PART).symlink_to("/proc/self/pagemap")


def _make_directory(root: Path) -> None:
    (root / PART).unlink()
    (root / PART).mkdir()


@pytest.mark.parametrize("plant", [_make_symlink_to_copy, _make_symlinked_rank_dir, _make_fifo, _make_device_link,
                                   _make_proc_link, _make_directory])
def test_only_regular_files_inside_the_directory_are_read_and_verify_never_hangs(cache_copy, built, plant):
    """A listed part replaced by a symlink (to an identical copy outside, /dev/zero,
    /proc/self/pagemap), a symlinked directory, a FIFO or a directory: open, lookup and
    verify refuse it by name, within seconds (a FIFO is opened non-blocking)."""
    plant(cache_copy)
    result: list[object] = []

    def run():
        try:
            result.append(serve_or_raise(cache_copy, built))
            result.append(verify_refuses(cache_copy))
        except BaseException as e:  # reported below, in the test's thread
            result.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "open/verify hung on a planted file"
    assert result[0] == "refused", result
    assert isinstance(result[1], RefCacheCorruptError) and "rank-00000" in str(result[1])


_EDITS = {
    "temperature": lambda fp: {**fp, "temperature": 0.5},
    "model_weights": lambda fp: {**fp, "model_weights": "0" * 32},
    "vocab_size": lambda fp: {**fp, "vocab_size": V + 1},
    "dtype": lambda fp: {**fp, "dtype": "float32"},
    "tokenizer": lambda fp: {**fp, "tokenizer": "0" * 32},
}


@pytest.mark.parametrize("field", sorted(_EDITS))
def test_fingerprint_edits_are_refused_whatever_the_manifest_vouches(cache_copy, built, field):
    """Editing a fingerprint field of the manifest and recomputing its checksum is refused on
    open with or without the caller's values (the index is stamped with what the manifest
    said at build time). A consistent forgery of manifest *and* index is still refused when
    the caller passes the model and temperature, because the caller's values are compared."""
    rewrite_manifest(cache_copy, lambda b: {**b, "fingerprint": _EDITS[field](b["fingerprint"])})
    edited = json.loads((cache_copy / "manifest.json").read_text())["fingerprint"]
    for kwargs in ({}, {"temperature": edited["temperature"]}, {"model": built["ref"]}):
        with pytest.raises(RefCacheCorruptError, match="manifest was edited") as e:
            RefCache.open(cache_copy, **kwargs)
        assert_named(e.value)
    verify_refuses(cache_copy)
    # forge consistently: re-finalize the same parts under the edited fingerprint
    parts = json.loads((cache_copy / "parts" / "rank-00000" / "done.json").read_text())["parts"]
    finalize(cache_copy, Fingerprint(**edited), parts)
    RefCache.open(cache_copy).verify()  # self-consistent now ...
    expected = {"model": built["ref"], "temperature": 1.0}
    if field == "tokenizer":
        expected["tokenizer"] = _Vocab(V)
    with pytest.raises(RefCacheMismatchError) as e:  # ... but not what the caller trains with
        RefCache.open(cache_copy, **expected)
    assert field in e.value.fields


class _Vocab:
    """The smallest tokenizer :func:`tokenizer_fingerprint` accepts."""

    def __init__(self, n: int) -> None:
        self.n = n

    def get_vocab(self) -> dict[str, int]:
        return {f"t{i}": i for i in range(self.n)}


# --- corruption ----------------------------------------------------------------------------

def test_single_byte_flips_are_detected_never_served_wrong(cache_copy, built):
    """Flip one byte (random xor) of the manifest, the index and every part: full verify
    always refuses with a named error; a fast open + lookup of every row either refuses with
    a named error or serves exactly the intact values (the flip sat where serving never reads).
    A sampled subset per run; LOGITLESS_FULL_FAULTS=1 flips every byte."""
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    outcomes = {"refused": 0, "served": 0}
    for f in cache_files_of(cache_copy):
        data = f.read_bytes()
        where = np.arange(len(data)) if FULL else rng.choice(len(data), size=min(len(data), 60), replace=False)
        for pos in where.tolist():
            flipped = bytearray(data)
            flipped[pos] ^= int(rng.integers(1, 256))
            f.write_bytes(flipped)
            try:
                outcomes[serve_or_raise(cache_copy, built)] += 1
                verify_refuses(cache_copy)
            except (AssertionError, pytest.fail.Exception) as e:
                raise AssertionError(f"byte {pos} of {f.name} (seed {seed}): {e}") from None
            f.write_bytes(data)
    assert sum(outcomes.values()) >= (4 * 60 if not FULL else 1000)
    assert outcomes["refused"] > 0


def test_truncated_extended_deleted_files_are_named(cache_copy, built):
    """Every file cut to 0, 1, a random length or one byte short, grown by a byte, or deleted."""
    rng = np.random.default_rng()
    for f in cache_files_of(cache_copy):
        data = f.read_bytes()
        for variant in (b"", data[:1], data[:int(rng.integers(1, len(data)))], data[:-1], data + b"\0", None):
            if variant is None:
                f.unlink()
            else:
                f.write_bytes(variant)
            assert serve_or_raise(cache_copy, built) == "refused", (f.name, None if variant is None else len(variant))
            e = verify_refuses(cache_copy)
            assert f.name in str(e)
            f.write_bytes(data)
    assert "no manifest" in str(verify_refuses_after(cache_copy, lambda: (cache_copy / "manifest.json").unlink()))


def verify_refuses_after(root: Path, damage) -> RefCacheError:
    damage()
    return verify_refuses(root)


_REPLACEMENTS = [None, -1, 0, 1, 2**70, 1.5, float("nan"), "x", "", True, [], {}, ["x"], {"x": 1}]


def _leaves(obj, path=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _leaves(v, (*path, i))
    yield path


def _set(obj, path, value):
    obj = json.loads(json.dumps(obj))
    if not path:
        return value
    target = obj
    for k in path[:-1]:
        target = target[k]
    target[path[-1]] = value
    return obj


def _drop(obj, path):
    obj = json.loads(json.dumps(obj))
    target = obj
    for k in path[:-1]:
        target = target[k]
    del target[path[-1]]
    return obj


def test_every_manifest_field_edited_with_a_recomputed_checksum(cache_copy, built):
    """Every node of the manifest (the document, each object, list and leaf) replaced by
    values of other types and ranges, or deleted, with the checksum recomputed as a hand
    edit would: a named error, or — only for informational fields — exactly the intact values."""
    original = json.loads((cache_copy / "manifest.json").read_text())
    original.pop("checksum")
    cases = served = 0
    for path in _leaves(original):
        edits = [_set(original, path, v) for v in _REPLACEMENTS]
        if path:
            edits.append(_drop(original, path))
        for body in edits:
            if body == original:
                continue
            write_manifest(cache_copy, body)
            cases += 1
            outcome = serve_or_raise(cache_copy, built)
            if outcome == "served":
                served += 1
                assert path[0] in ("created_at", "build"), f"edit of {path} was accepted"
            else:
                verify_refuses(cache_copy)
    for body in ([], None, "x", 1):
        (cache_copy / "manifest.json").write_text(json.dumps(body))
        assert serve_or_raise(cache_copy, built) == "refused"
    assert cases > 500 and served < cases / 4


# --- silent wrong values -------------------------------------------------------------------

def test_packed_position_ids_must_start_at_zero(built):
    recs = built["recs"][:3]
    flat = torch.tensor([t for s in recs for t in s])
    pos = torch.cat([torch.arange(len(s)) for s in recs])
    with RefCache.open(built["root"]) as cache:
        whole = cache.lookup_packed(flat, position_ids=pos)
        for i, s in enumerate(recs):
            a = sum(map(len, recs[:i]))
            assert (whole[a + 1:a + len(s)] - oracle(built["ref"], s)).abs().max() < 1e-12
        cut = 1 + int(torch.randint(0, len(recs[0]) - 1, ()))
        with pytest.raises(RefCacheMissError, match="position_ids starts at") as e:
            cache.lookup_packed(flat[cut:], position_ids=pos[cut:])
        assert e.value.length == len(recs[0]) - cut
        skipped = pos.clone()
        skipped[2] += 3
        with pytest.raises(ValueError, match=r"position_ids\[2\]"):
            cache.lookup_packed(flat, position_ids=skipped)


def test_float_token_ids_are_refused_naming_the_argument(built, tmp_path):
    ids, mask = built["ids"], built["mask"]
    flat = ids[0, :3]
    with RefCache.open(built["root"]) as cache:
        for call, name in [(lambda: cache.lookup(ids.double(), mask), "input_ids"),
                           (lambda: cache.lookup(ids.bool(), mask), "input_ids"),
                           (lambda: cache.lookup(ids.tolist(), mask), "input_ids"),
                           (lambda: cache.lookup_packed(flat.float(), cu_seqlens=torch.tensor([0, 3])), "input_ids"),
                           (lambda: cache.lookup_packed(flat, cu_seqlens=torch.tensor([0.0, 3.0])), "cu_seqlens"),
                           (lambda: cache.lookup_packed(flat, position_ids=torch.arange(3.0)), "position_ids"),
                           (lambda: cache.ref_logps_for(ids.float(), mask, ids, mask), "prompt_ids"),
                           (lambda: cache.ref_logps_for(ids, mask, ids.half(), mask), "completion_ids"),
                           (lambda: cache.sequence_logp_sums(ids.float(), mask), "input_ids"),
                           (lambda: torch.tensor([1.5, 2.0]) in cache, "integers")]:
            with pytest.raises(TypeError, match=name):
                call()
    bad = records(3, seed=2)
    for rec, name in [([1.5, 2.0, 3.0], "token ids"), ({"input_ids": [1.0, 2.0]}, "input_ids"),
                      ({"prompt_ids": [1, 2], "completion_ids": torch.tensor([3.0])}, "completion_ids"),
                      ({"prompt_ids": np.array([0.5, 1.0]), "completion_ids": [3]}, "prompt_ids"),
                      ([True, False], "token ids")]:
        with pytest.raises(TypeError, match=rf"record 3: {name} must be"):
            build(built["ref"], [*bad, rec], tmp_path / "f", options=opts())
    assert not (tmp_path / "f").exists()  # refused before anything was written


def test_out_of_vocabulary_id_names_the_record_and_V(built, tmp_path):
    recs = records(5, seed=3)
    j = int(torch.randint(0, len(recs[4]), ()))
    recs[4][j] = V + int(torch.randint(0, 5, ()))
    with pytest.raises(ValueError, match=rf"record 4: token id {recs[4][j]} at position {j} .*V = {V}"):
        build(built["ref"], recs, tmp_path / "oov", options=opts())
    assert not (tmp_path / "oov").exists()


# --- crashes, locks, disks -----------------------------------------------------------------

class _Crash(BaseException):
    """Stands for the process dying: no ``except Exception`` on the way catches it."""


def test_crash_at_every_write_then_resume_is_bit_identical(tmp_path, monkeypatch):
    """Die at each of the build's renames (state, every part, done, index, manifest), leaving
    the temporary file behind as a kill does: the directory never opens as a cache, and a
    rerun gives the files of an uninterrupted build byte for byte."""
    ref, recs = toy(), records(9, seed=4)
    build(ref, recs, tmp_path / "one", options=opts(entropy=True))
    want = snapshot(tmp_path / "one")
    real_replace = os.replace
    calls = [0]

    def counting(src, dst):
        calls[0] += 1
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", counting)
    build(ref, recs, tmp_path / "count", options=opts(entropy=True))
    renames = calls[0]
    assert renames >= 8
    for k in range(renames):
        calls[0] = 0

        def dying(src, dst, k=k):
            calls[0] += 1
            if calls[0] == k + 1:
                os.link(src, Path(src).with_name(Path(src).name + "-left.tmp"))  # what a kill leaves
                raise _Crash
            real_replace(src, dst)

        monkeypatch.setattr(os, "replace", dying)
        root = tmp_path / f"crash{k}"
        with pytest.raises(_Crash):
            build(ref, recs, root, options=opts(entropy=True))
        with pytest.raises(RefCacheCorruptError, match="no manifest"):
            RefCache.open(root)
        monkeypatch.setattr(os, "replace", real_replace)
        res = build(ref, recs, root, options=opts(entropy=True))
        assert res.manifest is not None
        assert snapshot(root) == want, f"crash at rename {k + 1} of {renames}"


_KILLED = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, sys.argv[1])
    from test_refcache_faults import opts, records, toy
    from logitless.refcache import build
    real, n, kill_at = os.replace, [0], int(sys.argv[3])
    def replace(src, dst):
        n[0] += 1
        if n[0] == kill_at:  # the part's bytes are written and fsynced, the rename not done
            os.kill(os.getpid(), signal.SIGKILL)
        real(src, dst)
    os.replace = replace
    build(toy(), records(9, seed=4), sys.argv[2], options=opts(entropy=True))
""")


def test_sigkill_mid_write_then_resume_is_bit_identical(tmp_path):
    ref, recs = toy(), records(9, seed=4)
    build(ref, recs, tmp_path / "one", options=opts(entropy=True))
    kill_at = int(np.random.default_rng().integers(2, 6))  # rename 1 is state.json; 2-6 are parts
    root = tmp_path / "killed"
    proc = subprocess.run([sys.executable, "-c", _KILLED, str(Path(__file__).parent), str(root), str(kill_at)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    rank = root / "parts" / "rank-00000"
    assert list(rank.glob(".part-*.tmp")) and len(list(rank.glob("part-*.arrow"))) == kill_at - 2
    with pytest.raises(RefCacheCorruptError, match="no manifest"):
        RefCache.open(root)
    res = build(ref, recs, root, options=opts(entropy=True))
    assert res.resumed_at == kill_at - 2 and not list(root.rglob("*.tmp"))
    assert snapshot(root) == snapshot(tmp_path / "one")


def test_two_builders_on_one_directory(tmp_path):
    """In this process: a second build started while the first one runs is refused with the
    holder's pid, and the first one finishes a correct cache. Across processes: a process
    holding the lock blocks a build until it is killed (the kernel releases its lock)."""
    ref, recs = toy(), records(8, seed=5)
    root = tmp_path / "c"
    refused = []

    def second_builder(done: int, total: int) -> None:
        if done == 2:
            with pytest.raises(RefCacheLockedError, match=rf"another build holds this directory \(pid {os.getpid()}"):
                build(ref, recs, root, options=opts())
            refused.append(done)

    build(ref, recs, root, options=opts(), on_batch=second_builder)
    assert refused == [2]
    build(ref, recs, tmp_path / "one", options=opts())
    assert snapshot(root) == snapshot(tmp_path / "one")

    other = tmp_path / "other"
    lock = other / "parts" / "rank-00000" / "build.lock"
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, sys, time
        f = open({str(lock)!r}, "w"); fcntl.flock(f, fcntl.LOCK_EX); f.write(str(os.getpid())); f.flush()
        print("held", flush=True); time.sleep(60)""")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RefCacheLockedError) as e:
            build(ref, recs, other, options=opts())
        assert e.value.pid == holder.pid and not (other / "manifest.json").exists()
    finally:
        holder.kill()
        holder.wait()
    build(ref, recs, other, options=opts())
    assert snapshot(other) == snapshot(tmp_path / "one")


def test_full_disk_is_a_named_error_and_resume_completes(tmp_path, monkeypatch, built):
    """The disk fills while the third file is written (half of it lands, then ENOSPC): a
    RefCacheWriteError (an OSError with errno ENOSPC) that says what to do, no temporary file
    left, earlier parts intact; once space is back a rerun equals an uninterrupted build. A
    finished cache in the way is never written to."""
    ref, recs = toy(), records(8, seed=6)
    build(ref, recs, tmp_path / "one", options=opts())
    real_write, calls = cache_files._write_all, [0]

    def filling(fd, data):
        calls[0] += 1
        if calls[0] == 3:
            os.write(fd, data[:len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_write(fd, data)

    monkeypatch.setattr(cache_files, "_write_all", filling)
    root = tmp_path / "c"
    with pytest.raises(RefCacheWriteError, match="Free disk space") as e:
        build(ref, recs, root, options=opts())
    assert isinstance(e.value, OSError) and e.value.errno == errno.ENOSPC and "part-000001" in str(e.value)
    assert not list(root.rglob("*.tmp")) and len(list(root.rglob("part-*.arrow"))) == 1
    monkeypatch.setattr(cache_files, "_write_all", real_write)
    build(ref, recs, root, options=opts())
    assert snapshot(root) == snapshot(tmp_path / "one")

    before = snapshot(built["root"])
    monkeypatch.setattr(cache_files, "_write_all", filling)
    calls[0] = -10**9  # not reached: nothing is written into a finished cache
    with pytest.raises(ValueError, match="already holds a finished cache"):
        build(ref, records(3, seed=7), built["root"], options=opts())
    build(built["ref"], built["recs"], built["root"], options=opts(entropy=True))  # same content: a no-op
    assert snapshot(built["root"]) == before


def _mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True).returncode == 0


def test_real_full_and_read_only_disk(tmp_path):
    """On a small tmpfs (skipped where it cannot be mounted): filling it is a RefCacheWriteError
    with ENOSPC; after growing it the build resumes to the uninterrupted result. Remounted
    read-only: resuming a partial build is a RefCacheWriteError with EROFS, while the finished
    cache next to it still opens and serves exactly its values."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "96k"):
        pytest.skip("needs root and tmpfs mounts")
    try:
        ref, recs = toy(), records(40, seed=8)
        build(ref, recs, tmp_path / "one", options=opts(batch_size=1))
        with pytest.raises(RefCacheWriteError) as e:
            build(ref, recs, disk / "c", options=opts(batch_size=1))
        assert e.value.errno == errno.ENOSPC and not list((disk / "c").rglob("*.tmp"))
        subprocess.run(["mount", "-o", "remount,size=8m", str(disk)], check=True)
        build(ref, recs, disk / "c", options=opts(batch_size=1))
        assert snapshot(disk / "c") == snapshot(tmp_path / "one")

        def stop_after_two(done: int, total: int) -> None:
            if done == 2:
                raise _Crash

        with pytest.raises(_Crash):
            build(ref, recs[:6], disk / "partial", options=opts(batch_size=1), on_batch=stop_after_two)
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        with pytest.raises(RefCacheWriteError) as e:
            build(ref, recs[:6], disk / "partial", options=opts(batch_size=1))
        assert e.value.errno == errno.EROFS
        build(ref, recs, disk / "c", options=opts(batch_size=1))  # finished: nothing to write
        ids, mask = padded(recs)
        with RefCache.open(disk / "c", model=ref, temperature=1.0, verify="full") as ro, \
                RefCache.open(tmp_path / "one") as rw:
            assert torch.equal(ro.lookup(ids, mask), rw.lookup(ids, mask))
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_read_only_directory_permissions(tmp_path):
    ref, recs = toy(), records(4, seed=9)
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o555)
    try:
        with pytest.raises(RefCacheWriteError) as e:
            build(ref, recs, root, options=opts())
        assert e.value.errno == errno.EACCES and list(root.iterdir()) == []
    finally:
        root.chmod(0o755)


def test_mismatched_model_tokenizer_temperature_and_missing_records(tmp_path):
    ref, recs = toy(), records(6, seed=10)
    root = tmp_path / "c"
    build(ref, recs, root, tokenizer=_Vocab(V), options=opts(temperature=0.8))
    RefCache.open(root, model=ref, tokenizer=_Vocab(V), temperature=0.8).close()
    for kwargs, field in [({"model": toy(seed=1)}, "model_weights"), ({"tokenizer": _Vocab(V - 1)}, "tokenizer"),
                          ({"temperature": 1.0}, "temperature"), ({"dtype": torch.float32}, "dtype")]:
        with pytest.raises(RefCacheMismatchError, match=field) as e:
            RefCache.open(root, **kwargs)
        assert set(e.value.fields) == {field}
    with pytest.raises(_Crash):  # a partial build at temperature 1.0 ...
        build(ref, recs[:3], tmp_path / "p", options=opts(batch_size=1), on_batch=_stop_at(1))
    with pytest.raises(RefCacheMismatchError, match="temperature"):  # ... is not resumed with other options
        build(ref, recs[:3], tmp_path / "p", options=opts(batch_size=1, temperature=0.8))
    with pytest.raises(RefCacheMismatchError, match="model_weights"):  # ... or another model
        build(toy(seed=1), recs[:3], tmp_path / "p", options=opts(batch_size=1))
    with pytest.raises(ValueError, match="already holds a finished cache"):
        build(toy(seed=1), recs, root, tokenizer=_Vocab(V), options=opts(temperature=0.8))
    absent = [*recs[0][:-1], (recs[0][-1] + 1) % V]
    ids, mask = padded([recs[1], absent])
    with RefCache.open(root) as cache:
        for call in (lambda: cache.lookup(ids, mask), lambda: cache.sequence_logp_sums(ids, mask),
                     lambda: cache.lookup_packed(torch.tensor(absent), cu_seqlens=torch.tensor([0, len(absent)])),
                     lambda: cache.ref_logps_for(ids[:, :1], mask[:, :1], ids[:, 1:], mask[:, 1:])):
            with pytest.raises(RefCacheMissError, match="is not in the reference cache") as e:
                call()
            assert e.value.length == len(absent)
        got = cache.lookup(ids[:1], mask[:1])
        assert (got[0, 1:len(recs[1])] - oracle(ref, recs[1], 0.8)).abs().max() < 1e-12


def _stop_at(n: int):
    def stop(done: int, total: int) -> None:
        if done == n:
            raise _Crash
    return stop


@pytest.mark.parametrize("damage", [b"", b"\xff\xfe{", b"[]", b"{}", b'{"plan": 1}', b'{"parts": 5}',
                                    b'{"parts": [{"name": "../../../outside.arrow", "bytes": 1, "blake2b": "0", '
                                    b'"values_at": {}}]}'])
def test_damaged_build_bookkeeping_is_named(tmp_path, damage):
    """A partial or sharded build whose state.json / done.json is damaged or crafted: resuming
    or merging raises a named error saying which rank to redo, and never reads outside."""
    ref, recs = toy(), records(6, seed=11)
    for r in (0, 1):
        build(ref, recs, tmp_path / "c", options=opts(), rank=r, world_size=2)
    rank1 = tmp_path / "c" / "parts" / "rank-00001"
    (rank1 / "done.json").write_bytes(damage)
    with pytest.raises(RefCacheError) as e:
        merge(tmp_path / "c")
    assert_named(e.value)
    assert "rank-00001" in str(e.value) or "parts" in str(e.value)
    (rank1 / "state.json").write_bytes(damage)
    (rank1 / "done.json").unlink()
    with pytest.raises(RefCacheError) as e:
        build(ref, recs, tmp_path / "c", options=opts(), rank=1, world_size=2)
    assert "rank-00001" in str(e.value) and isinstance(e.value, (RefCacheCorruptError, RefCacheMismatchError))


# --- enumerated options --------------------------------------------------------------------

@pytest.mark.parametrize("call, match", [
    (lambda c, ids, m: c.lookup(ids, m, what="bogus"), "what must be one of 'logp', 'entropy'; got 'bogus'"),
    (lambda c, ids, m: c.lookup_packed(ids[0], cu_seqlens=torch.tensor([0, 2]), what="logps"), "what must be one of"),
    (lambda c, ids, m: RefCache.open(c.path, verify="bogus"), "verify must be one of 'fast', 'full'"),
    (lambda c, ids, m: RefCache.open(c.path, verify=True), "verify must be one of"),
    (lambda c, ids, m: RefCache.open(c.path, temperature=0.0), "temperature must be a finite number > 0"),
    (lambda c, ids, m: RefCache.open(c.path, temperature=math.nan), "temperature must be"),
    (lambda c, ids, m: BuildOptions(hash_mode="bogus"), "hash_mode must be one of .'auto', 'full', 'sampled'."),
    (lambda c, ids, m: BuildOptions(temperature=-1.0), "temperature must be a finite number > 0"),
    (lambda c, ids, m: BuildOptions(batch_size=0), "batch_size must be an integer >= 1"),
    (lambda c, ids, m: BuildOptions(batch_size=2.5), "batch_size must be an integer >= 1"),
    (lambda c, ids, m: BuildOptions(chunk_bytes=-1), "chunk_bytes must be an integer >= 1"),
    (lambda c, ids, m: build(toy(), [[1, 2]], c.path.parent / "x", rank=2, world_size=2), "0 <= rank < world_size"),
])
def test_enumerated_and_ranged_options_are_checked(built, call, match):
    with RefCache.open(built["root"]) as cache:
        with pytest.raises(ValueError, match=match):
            call(cache, built["ids"], built["mask"])
