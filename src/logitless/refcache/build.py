"""Building a cache: batched no-grad passes, resumable, shardable across ranks.

The plan is deterministic: records are normalized (:mod:`.dataset`), duplicates merged
(their wanted positions united), the distinct sequences sorted by length (longest first, ties
in first-appearance order) and cut into batches of ``batch_size``. Batch ``b`` belongs to rank
``b % world_size``. Each rank appends its batches' rows to numbered part files, each written
atomically and recording the number of the rank's batches it completes; a restarted build
(same model, data and options) continues after the last complete part. Because the batches
are the same, a sharded or resumed build stores bit-identical values to a one-shot build on
the same hardware.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, get_args

import numpy as np
import torch
from tqdm.auto import tqdm

from ..ops import LogitTransform
from .dataset import Example, to_examples
from .errors import RefCacheCorruptError, RefCacheMismatchError
from .files import check_real_dirs, exclusive_lock, make_dir, read_bounded
from .fingerprint import Fingerprint, HashMode, Manifest, sequence_key
from .mac import load_key
from .model import ReferenceModel, as_reference, batch_logprobs
from .store import MANIFEST, PARTS, PartWriter, Store, finalize, part_metadata, remove_stale_temporaries, write_json

_STATE = "state.json"
_DONE = "done.json"


@dataclass(frozen=True)
class BuildOptions:
    """Settings of a build.

    Attributes:
        batch_size: sequences per forward pass.
        temperature: logits are divided by it before the softmax (TRL's ``temperature``).
        entropy: also store per-token entropies.
        part_bytes: a part file is written once this many value bytes are buffered.
        chunk_bytes: workspace budget of :func:`logitless.token_logprobs` (``None``: default).
        hash_mode: weights fingerprint mode (``"auto"``, ``"full"``, ``"sampled"``).
        progress: show a tqdm progress bar.
        key_file: file holding a secret key; the finished cache then carries an HMAC that
            :meth:`RefCache.open` checks with the same key (see ``docs/refcache.md``, "Trust and
            integrity"). ``None``: ``$LOGITLESS_REFCACHE_KEY`` if set, else no MAC. Never stored.
    """

    batch_size: int = 8
    temperature: float = 1.0
    entropy: bool = False
    part_bytes: int = 64 << 20
    chunk_bytes: int | None = None
    hash_mode: HashMode = "auto"
    progress: bool = True
    key_file: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        for name in ("batch_size", "part_bytes") + (("chunk_bytes",) if self.chunk_bytes is not None else ()):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        # The head's own check: a finite number > 0, NumPy scalars and one-element tensors included.
        object.__setattr__(self, "temperature", LogitTransform(temperature=self.temperature).temperature)
        if self.hash_mode not in get_args(HashMode):
            raise ValueError(f"hash_mode must be one of {get_args(HashMode)}, got {self.hash_mode!r}")
        if not isinstance(self.entropy, bool):
            raise TypeError(f"entropy must be a bool, got {self.entropy!r}")
        if self.key_file is not None and not isinstance(self.key_file, (str, os.PathLike)):
            raise TypeError(f"key_file must be a path to a file holding the key, got {type(self.key_file).__name__}")


@dataclass
class BuildResult:
    """What one call to :func:`build` did.

    Attributes:
        path: cache directory.
        rank, world_size: the shard built.
        batches: batches of this rank; ``resumed_at`` of them were already on disk.
        sequences, tokens: computed in this call.
        seconds: wall time of the forward passes in this call.
        manifest: the finished cache's manifest when this call merged it, else ``None``.
    """

    path: Path
    rank: int
    world_size: int
    batches: int
    resumed_at: int
    sequences: int
    tokens: int
    seconds: float
    manifest: Any | None


@dataclass
class _Plan:
    examples: list[Example]  # distinct sequences, in batch order
    keys: list[bytes]
    batches: list[range]
    digest: str


def _plan(examples: list[Example], batch_size: int) -> _Plan:
    uniq: dict[bytes, Example] = {}
    for ex in examples:
        k = sequence_key(ex.ids)
        have = uniq.get(k)
        if have is None:
            uniq[k] = Example(ex.ids, None if ex.mask is None else ex.mask.copy())
        elif have.mask is not None:  # union of the wanted positions
            have.mask = None if ex.mask is None else have.mask | ex.mask
    items = sorted(enumerate(uniq.items()), key=lambda it: (-len(it[1][1].ids), it[0]))
    keys = [k for _, (k, _) in items]
    exs = [e for _, (_, e) in items]
    h = hashlib.blake2b(digest_size=16, person=b"logitless-plan")
    h.update(f"{batch_size}\n".encode())
    for k, e in zip(keys, exs, strict=True):
        h.update(k)
        h.update(b"*" if e.mask is None else np.packbits(e.mask).tobytes() + b"|")
    batches = [range(s, min(s + batch_size, len(exs))) for s in range(0, len(exs), batch_size)]
    return _Plan(exs, keys, batches, h.hexdigest())


def _collate(exs: list[Example]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lengths = np.array([len(e.ids) for e in exs], np.int64)
    T = int(lengths.max())
    ids = np.zeros((len(exs), T), np.int64)
    want = np.zeros((len(exs), T), bool)
    for i, e in enumerate(exs):
        ids[i, :lengths[i]] = e.ids
        want[i, :lengths[i]] = True if e.mask is None else e.mask
    return torch.from_numpy(ids), torch.from_numpy(lengths), torch.from_numpy(want)


def _rank_dir(root: Path, rank: int) -> Path:
    return root / PARTS / f"rank-{rank:05d}"


def _state_digest(state: dict[str, Any]) -> str:
    """Digest of a rank's ``state.json`` as stored; every part of the rank records it, which binds
    the bookkeeping to the parts it describes (an edited ``state.json`` no longer merges)."""
    canon = json.dumps(state, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(canon, digest_size=16, person=b"logitless-state").hexdigest()


def _read_json(directory: Path, name: str) -> dict[str, Any]:
    """A bookkeeping file of a partial build (bounded read, regular files only).

    Raises:
        RefCacheCorruptError: unreadable, not UTF-8 JSON, or not an object.
    """
    try:
        obj = json.loads(read_bounded(directory, name).decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        obj = e
    if not isinstance(obj, dict):
        raise RefCacheCorruptError(directory / name, f"not a JSON object ({obj})",
                                   f"Delete {directory} and rerun the build to redo that rank")
    return obj


def _check_state(rank_dir: Path, state: dict[str, Any]) -> None:
    path = rank_dir / _STATE
    if not path.is_file():
        write_json(path, state)
        return
    old = _read_json(rank_dir, _STATE)
    if not isinstance(old.get("fingerprint"), dict):
        raise RefCacheCorruptError(path, "has no fingerprint",
                                   f"Delete {rank_dir} and rerun the build to redo that rank")
    diff = {k: (old.get(k), v) for k, v in state.items() if k != "fingerprint" and old.get(k) != v}
    fp_old, fp_new = old.get("fingerprint", {}), state["fingerprint"]
    diff.update({k: (fp_old.get(k), v) for k, v in fp_new.items()
                 if k != "library_version" and fp_old.get(k) != v})
    if diff:
        raise RefCacheMismatchError(diff, f"partial build in {rank_dir} (delete it to start over)")


def build(
    model: torch.nn.Module | ReferenceModel,
    dataset: Iterable[Any],
    path: str | Path,
    *,
    tokenizer: Any | None = None,
    options: BuildOptions | None = None,
    rank: int = 0,
    world_size: int = 1,
    on_batch: Callable[[int, int], None] | None = None,
) -> BuildResult:
    """Compute and store reference log-probs of ``dataset`` (this rank's share of it).

    For each distinct sequence ``x[0..L-1]`` stores ``logp[t] = log p(x[t] | x[:t])`` (nats,
    temperature applied) for ``1 <= t < L`` at the positions its records ask for (all of them
    by default), ``NaN`` elsewhere and at ``t = 0``. Values are fp32 (fp64 for fp64 models).

    Args:
        model: a Hugging Face causal LM (its backbone runs, never its logits) or a
            :class:`ReferenceModel`. Runs on its own device under ``torch.inference_mode``.
        dataset: records as described in :mod:`logitless.refcache.dataset`. Every rank must
            pass the same records.
        path: cache directory (created). Rerunning with the same arguments resumes.
        tokenizer: fingerprinted into the manifest when given.
        options: :class:`BuildOptions`.
        rank, world_size: this process's shard; ranks write disjoint part files. With
            ``world_size > 1`` call :func:`merge` once every rank has returned.
        on_batch: called as ``on_batch(done, total)`` after each batch is computed (progress
            hooks, tests).

    Returns:
        :class:`BuildResult`; with ``world_size == 1`` the cache is merged and ready.

    Raises:
        ValueError: bad ``rank``/``world_size`` or records; ``path`` holds a finished cache
            of other content.
        RefCacheMismatchError: ``path`` holds a partial build of another model, dataset or
            options.
        RefCacheLockedError: another process is building this rank into ``path``.
        RefCacheWriteError: ``path`` is not writable or the disk is full (files already there
            are unchanged; rerun to resume).
        RefCacheCorruptError: the partial build's bookkeeping files are damaged, or ``parts/``
            or this rank's directory is a symbolic link (refused before anything is written).
        TypeError: non-integer token ids or options of the wrong type.
    """
    options = options or BuildOptions()
    if not isinstance(options, BuildOptions):
        raise TypeError(f"options must be a BuildOptions, got {type(options).__name__}")
    for name, v in (("rank", rank), ("world_size", world_size)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if not (0 <= rank < world_size):
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    root = Path(path)
    key = load_key(options.key_file)
    ref = as_reference(model)
    examples = to_examples(dataset)
    _check_vocabulary(examples, int(ref.weight.shape[0]))
    fp = ref.fingerprint(tokenizer=tokenizer, temperature=options.temperature, mode=options.hash_mode)
    plan = _plan(examples, options.batch_size)
    state = {"plan": plan.digest, "world_size": world_size, "batch_size": options.batch_size,
             "entropy": options.entropy, "fingerprint": asdict(fp)}
    rank_dir = _rank_dir(root, rank)
    ours = (PARTS, f"{PARTS}/{rank_dir.name}")
    check_real_dirs(root, ours)  # a planted link would redirect every write below
    finished = _finished(root, plan, state, rank, key)
    if finished is not None:  # before locking: a finished cache on a read-only disk is fine
        return finished
    make_dir(rank_dir)
    check_real_dirs(root, ours)  # planted while we created them
    with exclusive_lock(rank_dir):
        finished = _finished(root, plan, state, rank, key)  # another builder may just have finished
        if finished is not None:
            return finished
        remove_stale_temporaries(rank_dir)
        _check_state(rank_dir, state)
        bound = _state_digest(_read_json(rank_dir, _STATE))
        return _build_rank(ref, plan, root, options, (rank, world_size), on_batch, state_digest=bound, key=key)


def _check_vocabulary(examples: list[Example], vocab_size: int) -> None:
    for i, ex in enumerate(examples):
        if int(ex.ids.max()) >= vocab_size:
            pos = int(np.argmax(ex.ids >= vocab_size))
            raise ValueError(f"record {i}: token id {int(ex.ids[pos])} at position {pos} is outside the model's "
                             f"vocabulary (V = {vocab_size}); was the data tokenized with another tokenizer?")


def _finished(root: Path, plan: _Plan, state: dict[str, Any], rank: int, key: bytes | None) -> BuildResult | None:
    """The result of a build whose finished cache is already in ``root``, else ``None``.

    Raises:
        RefCacheMismatchError: ``root`` holds a finished cache of other content (records, batch
            size, model, transform or entropy), or its MAC disagrees with ``key``.
    """
    if not (root / MANIFEST).is_file():
        return None
    done = Store(root, key=key).manifest
    # a build given no tokenizer does not contradict the one the cache recorded
    diff = done.fingerprint.mismatches({k: v for k, v in state["fingerprint"].items()
                                        if not (k == "tokenizer" and v is None)})
    if done.build.get("plan") != plan.digest:
        diff["plan (records and batch size)"] = (done.build.get("plan"), plan.digest)
    if state["entropy"] and not done.has_entropy:  # a cache with entropy serves a build without it
        diff["entropy"] = (done.has_entropy, state["entropy"])
    if diff:
        raise RefCacheMismatchError(diff, f"{root}, which already holds a finished cache of other content (use "
                                          "another directory, or delete this one to rebuild it),")
    n = len(range(rank, len(plan.batches), state["world_size"]))
    return BuildResult(root, rank, state["world_size"], n, n, 0, 0, 0.0, None)


def _build_rank(ref: ReferenceModel, plan: _Plan, root: Path, options: BuildOptions, shard: tuple[int, int],
                on_batch: Callable[[int, int], None] | None, *, state_digest: str, key: bytes | None) -> BuildResult:
    """The batches of one rank, with its lock held (see :func:`build`); every part records
    ``state_digest`` (of the rank's stored ``state.json``), and ``key`` signs the merged cache."""
    rank, world_size = shard
    rank_dir = _rank_dir(root, rank)
    value_dtype = np.float64 if ref.weight.dtype == torch.float64 else np.float32
    writer = PartWriter(root, rank, value_dtype)
    for p in writer.parts:
        if p["meta"].get("state") != state_digest:
            raise RefCacheCorruptError(rank_dir / Path(p["name"]).name, "was not written under this rank's "
                                       "state.json (edited bookkeeping, or a part of another build)",
                                       f"Delete {rank_dir} and rerun the build to redo that rank")
    mine = plan.batches[rank::world_size]
    start = max((int(p["meta"].get("batch_end", 0)) for p in writer.parts), default=0)
    seqs = toks = 0
    t0 = time.perf_counter()
    bar = tqdm(total=len(mine), initial=start, unit="batch", desc=f"refcache rank {rank}",
               disable=not options.progress)
    try:
        for j in range(start, len(mine)):
            exs = [plan.examples[i] for i in mine[j]]
            ids, lengths, want = _collate(exs)
            logp, ent = batch_logprobs(ref, ids, lengths, want, temperature=options.temperature,
                                       entropy=options.entropy, chunk_bytes=options.chunk_bytes)
            logp = logp.cpu().numpy()
            ent = None if ent is None else ent.cpu().numpy()
            lens = lengths.tolist()
            writer.add([plan.keys[i] for i in mine[j]], [logp[i, :n] for i, n in enumerate(lens)],
                       None if ent is None else [ent[i, :n] for i, n in enumerate(lens)])
            if writer.pending_bytes >= options.part_bytes:
                writer.flush({"batch_end": j + 1, "state": state_digest})
            seqs += len(exs)
            toks += int(lengths.sum())
            bar.update(1)
            bar.set_postfix(seq_s=f"{seqs / max(time.perf_counter() - t0, 1e-9):.1f}")
            if on_batch is not None:
                on_batch(j + 1, len(mine))
        writer.flush({"batch_end": len(mine), "state": state_digest})
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    write_json(rank_dir / _DONE, {"plan": plan.digest, "parts": writer.parts})
    manifest = _merge(root, key) if world_size == 1 else None
    return BuildResult(root, rank, world_size, len(mine), start, seqs, toks, seconds, manifest)


def merge(path: str | Path, *, key_file: str | os.PathLike[str] | None = None):
    """Index every rank's parts into one cache (writes ``index.arrow`` then ``manifest.json``).

    Merging never rewrites a finished cache: when ``manifest.json`` exists, its manifest is
    returned if the ranks' bookkeeping describes it (fingerprint, parts, build settings), and
    the merge is refused otherwise. Before an unfinished build is merged, each part must record
    the digest of its rank's ``state.json``, so edited bookkeeping (another model's weights
    fingerprint or another temperature) does not merge either.

    Args:
        path: the cache directory.
        key_file: file holding the MAC key (see :class:`BuildOptions`); ``None``:
            ``$LOGITLESS_REFCACHE_KEY`` if set, else no MAC.

    Returns:
        The :class:`~.fingerprint.Manifest`.

    Raises:
        ValueError: a rank has not finished, or ranks disagree on plan, fingerprint or options.
        RefCacheMismatchError: ``path`` holds a finished cache that its bookkeeping does not
            describe (left as it is), or whose MAC disagrees with the key.
        RefCacheLockedError: another process is merging into ``path``.
        RefCacheCorruptError: a rank's bookkeeping files are damaged or not bound to its parts,
            or ``parts/`` or a rank directory is a symbolic link.
        RefCacheWriteError: the index or manifest cannot be written.
    """
    return _merge(Path(path), load_key(key_file))


def _merge(root: Path, key: bytes | None):
    first = _rank_dir(root, 0)
    check_real_dirs(root, (PARTS, f"{PARTS}/{first.name}"))
    if not (first / _STATE).is_file():
        raise ValueError(f"{root} holds no build (no {first / _STATE})")
    state = _read_json(first, _STATE)
    try:
        world = int(state["world_size"])
        fp = Fingerprint(**state["fingerprint"])
        info = {k: state[k] for k in ("plan", "world_size", "batch_size", "entropy")}
        if world < 1:
            raise ValueError(f"world_size {world}")
    except (KeyError, TypeError, ValueError) as e:
        raise RefCacheCorruptError(first / _STATE, f"lacks build settings ({e})",
                                   f"Delete {root} and run the build again") from None
    parts: list[dict[str, Any]] = []
    for r in range(world):
        d = _rank_dir(root, r)
        check_real_dirs(root, (f"{PARTS}/{d.name}",))
        if not (d / _DONE).is_file():
            raise ValueError(f"rank {r} of {world} has not finished building into {d}")
        if _read_json(d, _STATE) != state:
            raise ValueError(f"rank {r} built a different plan or model than rank 0 ({d / _STATE} differs from "
                             f"{first / _STATE})")
        done = _read_json(d, _DONE)
        listed = done.get("parts")
        if done.get("plan") != state["plan"] or not isinstance(listed, list) or not all(
                isinstance(p, dict) and {"name", "bytes", "blake2b", "values_at"} <= set(p) for p in listed):
            raise RefCacheCorruptError(d / _DONE, "does not list the parts of this rank's plan",
                                       f"Delete {d} and build rank {r} again")
        for i, rec in enumerate(listed):
            if rec["name"] != f"{d.name}/part-{i:06d}.arrow":
                raise RefCacheCorruptError(d / _DONE, f"lists {rec['name']!r} as part {i} of {d.name}",
                                           f"Delete {d} and build rank {r} again")
        parts += listed
    with exclusive_lock(root, "merge.lock"):
        remove_stale_temporaries(root)
        if (root / MANIFEST).is_file():  # compared with the bookkeeping, never rewritten
            return _already_merged(root, key, fp, parts, info)
        _check_bound(root, parts, _state_digest(state))
        return finalize(root, fp, parts, build=info, key=key)


def _check_bound(root: Path, parts: list[dict[str, Any]], bound: str) -> None:
    """Each part must record the digest of the ``state.json`` it is merged under.

    Raises:
        RefCacheCorruptError: naming the first part written under other bookkeeping.
    """
    for rec in parts:
        if part_metadata(root, rec["name"]).get("state") != bound:
            d = root / PARTS / Path(rec["name"]).parent
            raise RefCacheCorruptError(root / PARTS / rec["name"], f"was not written under {d / _STATE} (the "
                                       "bookkeeping was edited, or the part comes from another build)",
                                       f"Delete {d} and build that rank again")


def _already_merged(root: Path, key: bytes | None, fp: Fingerprint, parts: list[dict[str, Any]],
                    info: dict[str, Any]) -> Manifest:
    """The manifest of the finished cache in ``root`` if the ranks' bookkeeping (its fingerprint
    ``fp``, ``parts`` and build settings ``info``) is what the manifest says; refused otherwise.

    Raises:
        RefCacheMismatchError: naming each field that differs.
    """
    have = Store(root, key=key).manifest
    diff: dict[str, tuple[object, object]] = {
        f"fingerprint.{k}": (v, getattr(fp, k)) for k, v in asdict(have.fingerprint).items() if getattr(fp, k) != v}
    names = [f"{PARTS}/{p['name']}" for p in parts]
    if have.parts != names:
        diff["parts"] = (have.parts, names)
    diff.update({f"build.{k}": (have.build.get(k), v) for k, v in info.items() if have.build.get(k) != v})
    if diff:
        raise RefCacheMismatchError(diff, f"{root} (a finished cache, left as it is: merge never rewrites one; its "
                                          "bookkeeping in parts/ was edited or comes from another build),")
    return have
