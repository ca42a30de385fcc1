"""``RefCache``: open a finished cache, check it against the model, serve rows.

Alignment (what a value means): for a sequence ``x[0..L-1]`` the cached value at position
``t`` is ``log p(x[t] | x[:t])`` in nats, from the model's hidden state at ``t - 1`` (logits
transformed by ``logit_scale``/``softcap`` and divided by ``temperature``). Position 0 has no
prefix; it is always served as 0. This is the alignment of TRL's ``ref_per_token_logps``:
with ``input_ids = prompt_ids ++ completion_ids`` the completion slice ``[:, P:]`` of the
per-position values is exactly ``ref_per_token_logps`` (see :meth:`RefCache.ref_logps_for`).

A *sequence* is identified by its token ids only: padding is excluded through the attention
mask, so the same text left- or right-padded, in any batch, order or packing, maps to the
same row. Values come from one unpadded pass per sequence; a live padded pass agrees up to
floating-point rounding of the attention kernels.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
import torch

from ..ops import LogitTransform
from .errors import RefCacheMismatchError, RefCacheMissError
from .fingerprint import Manifest, dtype_name, sequence_key, tokenizer_fingerprint
from .mac import load_key
from .model import ReferenceModel, as_reference
from .store import Store, manifest_summary

Field = Literal["logp", "entropy"]
VerifyMode = Literal["fast", "full"]


def _choice(value: object, name: str, kind: Any) -> None:
    if value not in get_args(kind):
        raise ValueError(f"{name} must be one of {', '.join(map(repr, get_args(kind)))}; got {value!r}")


def _token_ids(t: object, name: str) -> torch.Tensor:
    """``t`` if it is an integer tensor; a float id would silently hash as another sequence."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of token ids, got {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor of token ids, got {t.dtype}")
    return t


def _mask(t: object, name: str) -> torch.Tensor | None:
    if t is not None and not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    return t


class RefCache:
    """A memory-mapped reference log-prob cache. Use :meth:`open`.

    Attributes:
        path: the cache directory.
        manifest: its :class:`~.fingerprint.Manifest`.
    """

    def __init__(self, store: Store) -> None:
        self._store = store
        self.path = store.root
        self.manifest: Manifest = store.manifest

    # --- opening -----------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        path: str | Path,
        *,
        model: torch.nn.Module | ReferenceModel | None = None,
        tokenizer: Any | None = None,
        temperature: float | None = None,
        dtype: torch.dtype | None = None,
        verify: VerifyMode = "fast",
        key_file: str | os.PathLike[str] | None = None,
    ) -> RefCache:
        """Open a cache and check it against what the caller will train with.

        Args:
            path: cache directory.
            model: the reference model, or any model with the same weights (e.g. the policy
                before its first step); its weights fingerprint, vocabulary size, dtype and
                logit scale/soft-cap are compared. Not needed to serve rows.
            tokenizer: a tokenizer object with ``get_vocab()`` (e.g.
                ``AutoTokenizer.from_pretrained(path)``), compared by vocabulary fingerprint.
            temperature: compared with the build's temperature.
            dtype: compute dtype expected (default: the model's, when given).
            verify: ``"fast"`` checks file sizes and the index checksum (rows are checked
                as they are served); ``"full"`` also rehashes every part file.
            key_file: file holding the key the cache was built with (its MAC is checked);
                ``None``: ``$LOGITLESS_REFCACHE_KEY`` if set, else no key. With a key, a cache
                without a MAC is refused; without one, a cache with a MAC is.

        Raises:
            RefCacheCorruptError: missing/truncated/corrupt files, a manifest edited after the
                build (it no longer matches the index it was written with), or a MAC that does
                not match (the cache was changed after it was built with the key).
            RefCacheMismatchError: a compared field differs; ``.fields`` names each one (``mac``
                or ``key_check`` when the key and the cache's MAC disagree).
            ValueError: ``verify`` is not ``"fast"``/``"full"``, ``temperature`` is not > 0, or
                the key is unreadable or shorter than 16 bytes.
            TypeError: ``dtype`` is not a ``torch.dtype``; ``tokenizer`` has no ``get_vocab()``.
        """
        _choice(verify, "verify", VerifyMode)
        if temperature is not None:  # the head's own check (NumPy scalars and one-element tensors are numbers)
            temperature = LogitTransform(temperature=temperature).temperature
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        theirs_tok = None if tokenizer is None else tokenizer_fingerprint(tokenizer)
        store = Store(path, full_verify=verify == "full", key=load_key(key_file))
        fp = store.manifest.fingerprint
        expected: dict[str, Any] = {}
        if model is not None:
            ref = as_reference(model)
            mode = fp.weights_hash_mode if fp.weights_hash_mode in ("full", "sampled") else "auto"
            theirs = ref.fingerprint(temperature=fp.temperature, mode=mode)
            expected.update({k: getattr(theirs, k) for k in ("dtype", "logit_scale", "softcap", "vocab_size",
                                                             "model_weights")})
        if theirs_tok is not None:
            expected["tokenizer"] = theirs_tok
        if temperature is not None:
            expected["temperature"] = float(temperature)
        if dtype is not None:
            expected["dtype"] = dtype_name(dtype)
        bad = fp.mismatches(expected)
        if bad:
            raise RefCacheMismatchError(bad, str(path))
        return cls(store)

    def verify(self) -> None:
        """Rehash every file against the manifest.

        Raises:
            RefCacheCorruptError: naming the first bad file.
        """
        self._store.verify()

    def info(self) -> dict[str, Any]:
        """The manifest as a plain dict, plus ``total_bytes``."""
        return manifest_summary(self.manifest)

    def __len__(self) -> int:
        return len(self._store)

    def __contains__(self, input_ids: object) -> bool:
        ids = input_ids.detach().cpu().reshape(-1) if isinstance(input_ids, torch.Tensor) else input_ids
        return bool(self._store.find([sequence_key(ids)])[0] >= 0)

    def close(self) -> None:
        self._store.close()

    def __enter__(self) -> RefCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- serving -----------------------------------------------------------------------

    def _fetch(self, seqs: list[np.ndarray], what: Field) -> np.ndarray:
        """Values of each sequence concatenated (``[Σ L]``), raising on a missing one."""
        _choice(what, "what", Field)
        if what == "entropy" and not self.manifest.has_entropy:
            raise ValueError("this cache was built without entropy (BuildOptions(entropy=True))")
        keys = [sequence_key(s) for s in seqs]
        rows = self._store.find(keys)
        lens = np.array([len(s) for s in seqs], np.int64)
        bad = np.flatnonzero((rows < 0) | (self._store.length[np.maximum(rows, 0)] != lens))
        if bad.size:
            i = int(bad[0])
            s = seqs[i]
            preview = s[:8].tolist() + (["…"] if len(s) > 8 else [])
            raise RefCacheMissError(
                f"sequence {i} of the batch (length {len(s)}, token ids {preview}, key {keys[i].hex()}) is not "
                f"in the reference cache {self.path}"
                + (f"; {bad.size} of {len(seqs)} missing" if bad.size > 1 else ""),
                key=keys[i].hex(), row=i, length=len(s))
        return self._store.gather(rows, what)

    def _finish(self, out: torch.Tensor, want: torch.Tensor, seg_of: torch.Tensor, seqs: list[np.ndarray],
                device: torch.device | str | None, dtype: torch.dtype | None) -> torch.Tensor:
        """Zero positions not wanted; raise where a wanted one was not computed at build."""
        holes = want & torch.isnan(out)
        if bool(holes.any()):
            flat = int(holes.reshape(-1).nonzero()[0, 0])
            i = int(seg_of.reshape(-1)[flat])
            raise RefCacheMissError(
                f"sequence {i} of the batch is cached, but not every requested position was computed at build "
                f"time (its loss mask there was narrower); {int(holes.sum())} position(s) missing",
                key=sequence_key(seqs[i]).hex(), row=i, length=len(seqs[i]))
        out = torch.where(want, out, torch.zeros((), dtype=out.dtype))
        return out.to(device=device, dtype=dtype or out.dtype)

    def lookup(
        self,
        input_ids: torch.Tensor,  # [B, T] int
        mask: torch.Tensor | None = None,  # [B, T] attention mask: 1 = token of the sequence, 0 = padding
        *,
        loss_mask: torch.Tensor | None = None,  # [B, T] positions to serve
        what: Field = "logp",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Cached values for a padded batch, aligned with ``input_ids``.

        Row ``b``'s sequence is ``input_ids[b][mask[b] == 1]`` in order (left, right or any
        padding). ``out[b, p]`` is the cached log-prob of the token at ``p`` given the
        sequence tokens before it.

        Args:
            input_ids: ``[B, T]`` integer token ids, any device.
            mask: ``[B, T]`` attention mask (default: no padding).
            loss_mask: ``[B, T]`` positions to serve (default: every sequence token after the
                first); positions outside it, padding and each sequence's first token are 0.
            what: ``"logp"`` or ``"entropy"`` (nats; needs a cache built with entropy).
            device: output device (default: ``input_ids.device``).
            dtype: output dtype (default: the stored dtype, fp32, or fp64 for fp64 builds).

        Returns:
            ``[B, T]`` tensor.

        Raises:
            RefCacheMissError: a sequence is not cached, or a served position was not computed
                at build time; names the batch row, length, leading token ids and key.
            RefCacheCorruptError: a row fails its checksum, or holds a log-prob that is not finite
                and <= 0 (an entropy outside ``[0, log V]``): a forged or miscomputed cache.
            ValueError: shapes differ, ``what`` is not ``"logp"``/``"entropy"``, or entropy
                requested from a cache without it.
            TypeError: ``input_ids`` is not an integer tensor.
        """
        _choice(what, "what", Field)
        if _token_ids(input_ids, "input_ids").dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        ids = input_ids.detach().cpu().long()
        m = torch.ones_like(ids, dtype=torch.bool) if _mask(mask, "mask") is None else mask.detach().cpu().bool()
        if m.shape != ids.shape:
            raise ValueError(f"mask shape {tuple(m.shape)} differs from input_ids shape {tuple(ids.shape)}")
        ids_np, m_np = ids.numpy(), m.numpy()
        seqs = [ids_np[b][m_np[b]] for b in range(ids.shape[0])]
        vals = torch.from_numpy(self._fetch(seqs, what))
        out = torch.zeros(ids.shape, dtype=vals.dtype).masked_scatter_(m, vals)
        first = m & (m.long().cumsum(1) == 1)
        want = m & ~first
        if _mask(loss_mask, "loss_mask") is not None:
            lm = loss_mask.detach().cpu().bool()
            if lm.shape != ids.shape:
                raise ValueError(f"loss_mask shape {tuple(lm.shape)} differs from input_ids shape {tuple(ids.shape)}")
            want &= lm
        seg_of = torch.arange(ids.shape[0])[:, None].expand_as(ids)
        return self._finish(out, want, seg_of, seqs, device or input_ids.device, dtype)

    def lookup_packed(
        self,
        input_ids: torch.Tensor,  # [N] int, sequences back to back
        *,
        cu_seqlens: torch.Tensor | None = None,  # [S + 1] sequence boundaries
        position_ids: torch.Tensor | None = None,  # [N], 0 where a sequence starts
        loss_mask: torch.Tensor | None = None,  # [N]
        what: Field = "logp",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Cached values for packed sequences (``[N]`` tokens, no padding between them).

        Sequence ``s`` is ``input_ids[cu_seqlens[s]:cu_seqlens[s+1]]``; give either
        ``cu_seqlens`` (flash-attention style, non-decreasing, within ``[0, N]``) or
        ``position_ids`` (TRL/HF padding-free style: ``0, 1, 2, ...`` within each sequence, a
        sequence starts where it is 0). Tokens outside ``[cu_seqlens[0], cu_seqlens[-1])`` are
        padding and get 0.

        Returns:
            ``[N]`` tensor; otherwise as :meth:`lookup` (same errors).

        Raises:
            RefCacheMissError: also when ``position_ids`` does not start at 0: the first tokens
                continue a sequence whose beginning is not in ``input_ids``, so it cannot be
                looked up (pass whole sequences).
            ValueError: also ``position_ids`` that do not count up by one within a sequence.
            TypeError: ``input_ids``, ``cu_seqlens`` or ``position_ids`` is not an integer tensor.
        """
        _choice(what, "what", Field)
        if _token_ids(input_ids, "input_ids").dim() != 1:
            raise ValueError(f"input_ids must be [N], got shape {tuple(input_ids.shape)}")
        ids = input_ids.detach().cpu().long()
        N = ids.shape[0]
        if (cu_seqlens is None) == (position_ids is None):
            raise ValueError("give exactly one of cu_seqlens and position_ids")
        if cu_seqlens is None:
            pos = _token_ids(position_ids, "position_ids").detach().cpu().long().reshape(-1)
            if pos.shape[0] != N:
                raise ValueError(f"position_ids has {pos.shape[0]} entries, input_ids {N}")
            if N and int(pos[0]) != 0:
                head = int(pos.numel() if bool((pos != 0).all()) else (pos == 0).nonzero()[0, 0])
                raise RefCacheMissError(
                    f"position_ids starts at {int(pos[0])}, not 0: the first {head} token(s) continue a sequence "
                    "whose beginning is not in input_ids, and the cache keys a sequence by all of its tokens; "
                    "pass whole sequences (gather a sequence split across ranks before the lookup)",
                    key=sequence_key(ids[:head]).hex(), row=0, length=head)
            step = (pos[1:] == pos[:-1] + 1) | (pos[1:] == 0)
            if not bool(step.all()):
                i = int((~step).nonzero()[0, 0]) + 1
                raise ValueError(f"position_ids must count 0, 1, 2, ... within each sequence; position_ids[{i}] = "
                                 f"{int(pos[i])} follows {int(pos[i - 1])}")
            starts = (pos == 0).nonzero().reshape(-1)
            cu = torch.cat([starts, torch.tensor([N])]) if starts.numel() else torch.tensor([0, 0])
        else:
            cu = _token_ids(cu_seqlens, "cu_seqlens").detach().cpu().long().reshape(-1)
        if cu.numel() < 1 or bool((cu[1:] < cu[:-1]).any()) or int(cu[0]) < 0 or int(cu[-1]) > N:
            raise ValueError(f"cu_seqlens must be non-decreasing within [0, {N}], got {cu.tolist()}")
        lens = (cu[1:] - cu[:-1]).tolist()
        ids_np = ids.numpy()
        seqs = [ids_np[a:a + n] for a, n in zip(cu[:-1].tolist(), lens, strict=True) if n > 0]
        vals = torch.from_numpy(self._fetch(seqs, what))
        lo, hi = int(cu[0]), int(cu[-1])
        out = torch.zeros(N, dtype=vals.dtype)
        out[lo:hi] = vals
        want = torch.zeros(N, dtype=torch.bool)
        want[lo:hi] = True
        want[cu[:-1][torch.tensor(lens) > 0]] = False  # each sequence's first token
        seg_of = torch.zeros(N, dtype=torch.long)
        seg_of[lo:hi] = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor([n for n in lens if n > 0],
                                                                                      dtype=torch.long))
        if _mask(loss_mask, "loss_mask") is not None:
            lm = loss_mask.detach().cpu().bool().reshape(-1)
            if lm.shape[0] != N:
                raise ValueError(f"loss_mask has {lm.shape[0]} entries, input_ids {N}")
            want &= lm
        return self._finish(out, want, seg_of, seqs, device or input_ids.device, dtype)

    def ref_logps_for(
        self,
        prompt_ids: torch.Tensor,  # [B, P]
        prompt_mask: torch.Tensor,  # [B, P]
        completion_ids: torch.Tensor,  # [B, C]
        completion_mask: torch.Tensor,  # [B, C]
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = torch.float32,
    ) -> torch.Tensor:
        """TRL's ``ref_per_token_logps``: ``[B, C]`` log-probs of the completion tokens.

        The sequence of row ``b`` is its kept prompt tokens followed by its kept completion
        tokens (``input_ids = cat(prompt_ids, completion_ids)``, ``attention_mask =
        cat(prompt_mask, completion_mask)`` as TRL forms them). ``out[b, j]`` is the log-prob
        of ``completion_ids[b, j]`` given everything before it, and 0 where
        ``completion_mask[b, j] == 0``.

        Args:
            device: output device (default: ``completion_ids.device``).
            dtype: output dtype (default fp32, as TRL's).

        Raises:
            RefCacheMissError, RefCacheCorruptError, ValueError: as :meth:`lookup`.
        """
        _token_ids(prompt_ids, "prompt_ids")
        _token_ids(completion_ids, "completion_ids")
        if prompt_ids.shape != prompt_mask.shape or completion_ids.shape != completion_mask.shape:
            raise ValueError("prompt_ids/prompt_mask and completion_ids/completion_mask must have equal shapes")
        P = prompt_ids.shape[1]
        ids = torch.cat([prompt_ids.detach().cpu(), completion_ids.detach().cpu()], 1)
        cm = completion_mask.detach().cpu().bool()
        attn = torch.cat([prompt_mask.detach().cpu().bool(), cm], 1)
        loss = torch.cat([torch.zeros_like(prompt_mask, dtype=torch.bool, device="cpu"), cm], 1)
        out = self.lookup(ids, attn, loss_mask=loss, device="cpu", dtype=dtype)
        return out[:, P:].to(device or completion_ids.device)

    def sequence_logp_sums(
        self,
        input_ids: torch.Tensor,  # [B, T]
        mask: torch.Tensor | None = None,  # [B, T] attention mask
        *,
        loss_mask: torch.Tensor | None = None,  # [B, T]
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """``[B]`` fp64 sums of the cached log-probs over the served positions (DPO's
        ``ref_chosen_logps``/``ref_rejected_logps``: pass the completion as ``loss_mask``).

        Raises:
            As :meth:`lookup`.
        """
        vals = self.lookup(input_ids, mask, loss_mask=loss_mask, device="cpu", dtype=torch.float64)
        return vals.sum(1).to(device or input_ids.device)
