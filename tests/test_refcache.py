"""Reference log-prob cache: values, alignment, layouts, resume, shards, fingerprints.

Models are tiny Qwen2s built from a config (no hub). Exactness is checked two ways: against
a live pass through the same code path (bit-identical), and against the model's own logits'
``log_softmax`` in float64 (1e-10: the only difference is summation order).
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from logitless import token_logprobs
from logitless.refcache import (
    BuildOptions,
    RefCache,
    RefCacheMismatchError,
    RefCacheMissError,
    build,
    free_reference,
    merge,
    weights_fingerprint,
)

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import save_tiny_qwen2, word_tokenizer

V = 64
QUIET = BuildOptions(progress=False)


def _opts(**kw) -> BuildOptions:
    return BuildOptions(progress=False, **kw)


def _records(n: int, seed: int, max_len: int = 24) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, max_len, (n,), generator=g).tolist()
    return [torch.randint(0, V - 3, (L,), generator=g).tolist() for L in lens]


def _load(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    return {"untied": save_tiny_qwen2(d / "untied", vocab_size=V, hidden_size=32, tie=False, seed=0),
            "tied": save_tiny_qwen2(d / "tied", vocab_size=V, hidden_size=32, tie=True, seed=1),
            "other_seed": save_tiny_qwen2(d / "other", vocab_size=V, hidden_size=32, tie=False, seed=7)}


@pytest.fixture(scope="module")
def fp32(models):
    return _load(models["untied"], torch.float32)


@pytest.fixture(scope="module")
def fp64(models):
    return _load(models["tied"], torch.float64)


def _pad(seqs: list[list[int]], left: bool, pad: int = V - 3) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(map(len, seqs)) + 2  # extra padding on every row
    ids = torch.full((len(seqs), T), pad)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        sl = slice(T - len(s), T) if left else slice(0, len(s))
        ids[i, sl], mask[i, sl] = torch.tensor(s), 1
    return ids, mask


def _logsoftmax_ref(model, seq: list[int], temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position (log-prob, entropy) of ``seq[1:]`` from the model's own logits, fp64."""
    with torch.no_grad():
        z = model(torch.tensor([seq])).logits[0, :-1].double() / temperature
    lp = z.log_softmax(-1)
    return lp.gather(1, torch.tensor(seq[1:])[:, None])[:, 0], -(lp.exp() * lp).sum(-1)


def test_values_equal_live_pass_bit_for_bit(fp32, tmp_path):
    """fp32 model, batch of one: the stored value is exactly what a live
    ``token_logprobs(backbone(x)[:-1], W, x[1:])`` gives, and lookup moves it unchanged."""
    recs = _records(12, seed=1)
    build(fp32, recs, tmp_path / "c", options=_opts(batch_size=1))
    cache = RefCache.open(tmp_path / "c", model=fp32)
    ids, mask = _pad(recs, left=False)
    out = cache.lookup(ids, mask)
    assert out.dtype == torch.float32 and out.shape == ids.shape
    W = fp32.get_output_embeddings().weight
    with torch.no_grad():
        for i, s in enumerate(recs):
            h = fp32.model(input_ids=torch.tensor([s]), attention_mask=torch.ones(1, len(s))).last_hidden_state
            live = token_logprobs(h[0, :-1], W, torch.tensor(s[1:]))
            assert torch.equal(out[i, 1:len(s)], live)
            assert out[i, 0] == 0 and (out[i, len(s):] == 0).all()


def test_fp64_matches_log_softmax_padded_packed_shuffled_duplicates(fp64, tmp_path):
    """Tied-embedding fp64 model at temperature 0.7 with entropy; served left-padded,
    right-padded and packed, shuffled, with duplicate rows in the batch and the dataset."""
    recs = _records(20, seed=2)
    build(fp64, recs + recs[:5], tmp_path / "c", options=_opts(batch_size=6, temperature=0.7, entropy=True))
    cache = RefCache.open(tmp_path / "c", model=fp64, temperature=0.7, dtype=torch.float64)
    assert len(cache) == 20 and cache.manifest.value_dtype == "float64"
    order = torch.randperm(20, generator=torch.Generator().manual_seed(0)).tolist()
    batch = [recs[i] for i in order] + [recs[order[0]], recs[order[3]]]
    refs = [_logsoftmax_ref(fp64, s, 0.7) for s in batch]
    for left in (True, False):
        ids, mask = _pad(batch, left)
        lp, ent = cache.lookup(ids, mask), cache.lookup(ids, mask, what="entropy")
        assert lp.dtype == torch.float64
        for i in range(len(batch)):
            pos = mask[i].nonzero()[:, 0]
            assert (lp[i, pos[1:]] - refs[i][0]).abs().max() < 1e-10
            assert (ent[i, pos[1:]] - refs[i][1]).abs().max() < 1e-10
            assert lp[i, pos[0]] == 0 and (lp[i][mask[i] == 0] == 0).all()
    # packed: [pad, pad, seq0, seq1, ...,  pad]
    flat = torch.tensor([V - 3, V - 3, *itertools.chain(*batch), V - 3])
    lens = torch.tensor([len(s) for s in batch])
    cu = torch.cat([torch.tensor([2]), 2 + lens.cumsum(0)])
    packed = cache.lookup_packed(flat, cu_seqlens=cu)
    pos_ids = torch.cat([torch.arange(2), *[torch.arange(n) for n in lens.tolist()], torch.arange(1)])
    packed_pos = cache.lookup_packed(flat[2:-1], position_ids=pos_ids[2:-1])
    assert torch.equal(packed[2:-1], packed_pos)
    assert (packed[:2] == 0).all() and packed[-1] == 0
    for i, s in enumerate(batch):
        a = int(cu[i])
        assert packed[a] == 0 and (packed[a + 1:a + len(s)] - refs[i][0]).abs().max() < 1e-10
    sums = cache.sequence_logp_sums(*_pad(batch, left=True))
    assert sums.dtype == torch.float64
    assert torch.allclose(sums, torch.stack([r[0].sum() for r in refs]), atol=1e-10, rtol=0)


def test_trl_completion_layout_and_partial_build(fp64, tmp_path):
    """Records in TRL's prompt/completion form compute only completion positions;
    ``ref_logps_for`` reproduces TRL's ``ref_per_token_logps`` (left-padded prompts,
    right-padded completions cut at EOS); asking for a prompt position is a named miss."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, V - 3, (n,), generator=g).tolist() for n in (3, 6, 4)]
    comps = [torch.randint(0, V - 3, (n,), generator=g).tolist() for n in (5, 2, 7)]
    recs = [{"prompt_ids": p, "completion_ids": c} for p, c in zip(prompts, comps, strict=True)]
    build(fp64, recs, tmp_path / "c", options=_opts(batch_size=2))
    cache = RefCache.open(tmp_path / "c")
    p_ids, p_mask = _pad(prompts, left=True)
    c_ids, c_mask = _pad(comps, left=False)
    out = cache.ref_logps_for(p_ids, p_mask, c_ids, c_mask)
    assert out.shape == c_ids.shape and out.dtype == torch.float32
    # TRL: logits of cat(prompt, completion) under the joint attention mask, completion slice
    ids, attn = torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1)
    with torch.no_grad():
        logits = fp64(input_ids=ids, attention_mask=attn).logits[:, p_ids.shape[1] - 1:-1]
    trl = logits.log_softmax(-1).gather(2, c_ids[..., None])[..., 0] * c_mask
    # 1e-6: fp32 output, and Qwen2 computes RoPE angles in fp32, so a left-padded live pass
    # (positions shifted by the padding) differs from the unpadded one by ~1e-9 even in fp64.
    assert (out.double() - trl).abs().max() < 1e-6
    exact = cache.ref_logps_for(p_ids, p_mask, c_ids, c_mask, dtype=torch.float64)
    for i, (p, c) in enumerate(zip(prompts, comps, strict=True)):
        unpadded = _logsoftmax_ref(fp64, p + c)[0][len(p) - 1:]
        assert (exact[i, :len(c)] - unpadded).abs().max() < 1e-10 and (exact[i, len(c):] == 0).all()
    with pytest.raises(RefCacheMissError, match="not every requested position was computed") as e:
        cache.lookup(ids, attn)  # default: every position, prompts included
    assert e.value.row == 0


def test_missing_sequence_is_a_named_key_error(fp32, tmp_path):
    recs = _records(6, seed=4)
    build(fp32, recs, tmp_path / "c", options=QUIET)
    cache = RefCache.open(tmp_path / "c")
    other = [*recs[2][:-1], (recs[2][-1] + 1) % (V - 3)]
    ids, mask = _pad([recs[0], other], left=True)
    with pytest.raises(KeyError) as e:
        cache.lookup(ids, mask)
    assert isinstance(e.value, RefCacheMissError) and isinstance(e.value, LookupError)
    assert e.value.row == 1 and e.value.length == len(other) and "sequence 1" in str(e.value)
    assert torch.tensor(recs[0]) in cache and torch.tensor(other) not in cache


def test_mismatched_model_tokenizer_dtype_temperature_refused(models, fp32, tmp_path):
    build(fp32, _records(4, seed=5), tmp_path / "c", tokenizer=word_tokenizer(V), options=_opts(temperature=0.9))
    RefCache.open(tmp_path / "c", model=fp32, tokenizer=word_tokenizer(V), temperature=0.9)  # all match
    cases = [({"model": _load(models["other_seed"], torch.float32)}, "model_weights"),
             ({"temperature": 1.0}, "temperature"),
             ({"model": _load(models["untied"], torch.float64)}, "dtype"),
             ({"dtype": torch.bfloat16}, "dtype"),
             ({"tokenizer": word_tokenizer(V + 1)}, "tokenizer")]
    for kwargs, field in cases:
        with pytest.raises(RefCacheMismatchError, match=field) as e:
            RefCache.open(tmp_path / "c", **kwargs)
        assert field in e.value.fields


def test_resume_after_interrupted_build_equals_one_shot(fp32, tmp_path):
    recs = _records(14, seed=6)
    one_shot = tmp_path / "one"
    build(fp32, recs, one_shot, options=_opts(batch_size=2))

    class Interrupt(Exception):
        pass

    def die_after_3(done: int, total: int) -> None:
        if done == 3:
            raise Interrupt

    opts = _opts(batch_size=2, part_bytes=1)  # a part per batch
    with pytest.raises(Interrupt):
        build(fp32, recs, tmp_path / "r", options=opts, on_batch=die_after_3)
    assert not (tmp_path / "r" / "manifest.json").exists()
    with pytest.raises(RefCacheMismatchError, match="temperature"):
        build(fp32, recs, tmp_path / "r", options=_opts(batch_size=2, part_bytes=1, temperature=2.0))
    res = build(fp32, recs, tmp_path / "r", options=opts)
    assert res.resumed_at == 3 and res.batches == 7 and res.sequences == 8
    ids, mask = _pad(recs, left=False)
    assert torch.equal(RefCache.open(one_shot).lookup(ids, mask), RefCache.open(tmp_path / "r").lookup(ids, mask))


def test_two_shards_merged_equal_single_build(fp32, tmp_path):
    recs = _records(17, seed=8)
    build(fp32, recs, tmp_path / "single", options=_opts(batch_size=3))
    r0 = build(fp32, recs, tmp_path / "sharded", options=_opts(batch_size=3), rank=0, world_size=2)
    assert r0.manifest is None
    with pytest.raises(ValueError, match="rank 1 of 2 has not finished"):
        merge(tmp_path / "sharded")
    build(fp32, recs, tmp_path / "sharded", options=_opts(batch_size=3), rank=1, world_size=2)
    m = merge(tmp_path / "sharded")
    single = RefCache.open(tmp_path / "single")
    assert m.num_sequences == single.manifest.num_sequences == 17 and len(m.parts) == 2
    ids, mask = _pad(recs, left=False)
    assert torch.equal(RefCache.open(tmp_path / "sharded", model=fp32).lookup(ids, mask), single.lookup(ids, mask))


_KILLABLE = """
import sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from logitless.refcache import BuildOptions, build, load_records
model_dir, data, out = sys.argv[1:4]
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
options = BuildOptions(batch_size=1, temperature=1.3, part_bytes=1, progress=False)
build(model, load_records(data), out, tokenizer=AutoTokenizer.from_pretrained(model_dir), options=options,
      on_batch=lambda done, total: time.sleep(0.2))
"""


def test_killed_build_resumed_by_cli_read_in_this_process(models, fp64, tmp_path, capsys):
    """A build process is SIGKILLed after some parts landed; the CLI (another process,
    parquet input) resumes it; this process reads the result and checks every value."""
    import time

    import pyarrow as pa
    import pyarrow.parquet as pq

    from logitless.cli import main

    recs = _records(30, seed=9)
    data = tmp_path / "d.parquet"
    pq.write_table(pa.table({"input_ids": recs}), data)
    out, parts = tmp_path / "c", tmp_path / "c" / "parts" / "rank-00000"
    proc = subprocess.Popen([sys.executable, "-c", _KILLABLE, str(models["tied"]), str(data), str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 40
    while time.time() < deadline and len(list(parts.glob("part-*.arrow"))) < 3 and proc.poll() is None:
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    n_before = len(list(parts.glob("part-*.arrow")))
    assert 3 <= n_before < 30 and not (out / "manifest.json").exists()
    done = subprocess.run([sys.executable, "-m", "logitless.cli", "refcache", "build", "--model", str(models["tied"]),
                           "--data", str(data), "--out", str(out), "--dtype", "float64", "--temperature", "1.3",
                           "--batch-size", "1", "--part-bytes", "1", "--no-progress"],
                          check=True, capture_output=True, text=True)
    assert int(done.stdout.split("resumed at batch ")[1].split("/")[0]) >= n_before
    cache = RefCache.open(out, model=fp64, tokenizer=word_tokenizer(V), temperature=1.3)
    ids, mask = _pad(recs, left=True)
    got = cache.lookup(ids, mask)
    for i, s in enumerate(recs):
        assert (got[i][mask[i].bool()][1:] - _logsoftmax_ref(fp64, s, 1.3)[0]).abs().max() < 1e-10
    assert main(["refcache", "info", str(out)]) == 0
    assert "Qwen2ForCausalLM" in capsys.readouterr().out
    assert main(["refcache", "verify", str(out)]) == 0


def test_free_reference_releases_weights(models):
    model = _load(models["tied"], torch.float32)
    head = model.get_output_embeddings().weight  # a reference held elsewhere
    n_before = head.untyped_storage().nbytes()
    assert n_before > 0
    free_reference(model)
    assert all(p.is_meta for p in model.parameters())
    assert head.untyped_storage().nbytes() == 0
    with pytest.raises(ValueError, match="meta"):
        weights_fingerprint(model)
