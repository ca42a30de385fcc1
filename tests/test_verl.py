"""The verl adapter against verl's own reference: ``FusedLinearForPPO`` of
``verl/utils/experimental/torch_functional.py`` (github.com/volcengine/verl, commit
0a1b97a1589c83d030b57a276abaaa27787520e9), transcribed below because verl does not install
without its heavy dependencies. Its log-probs, entropy and analytic backward are checked in
float64, single-process and vocabulary-parallel over 2 gloo ranks."""

from __future__ import annotations

import os
import socket
import sys
import types

import pytest
import torch
import torch.multiprocessing as mp

from logitless.integrations.verl import FusedLinearForPPO, linear_cross_entropy, patch_verl


# ---- verl's reference, transcribed (torch_functional.py: _fused_linear_for_ppo_fwd / _bwd) ----
# verl casts the logits to fp32; for float64 inputs that cast is left out here, so the float64
# comparison checks verl's formulas (log-softmax gather, entropy, the analytic dlogits) exactly.
def _verl_fwd(hidden_states, vocab_weights, input_ids, temperature=1.0):
    logits = (hidden_states @ vocab_weights.t()) / temperature
    orig_dtype = logits.dtype
    logits = logits.to(torch.float32) if orig_dtype != torch.float64 else logits
    probs = logits.softmax(dim=-1)
    log_probs = logits.log_softmax(dim=-1)
    token_log_probs = log_probs.gather(-1, input_ids.unsqueeze(-1)).squeeze(-1)
    entropy = torch.logsumexp(logits, dim=-1) - torch.sum(probs * logits, dim=-1)
    return token_log_probs.to(orig_dtype), entropy.to(orig_dtype)


def _verl_bwd(dlog_probs, dentropy, hidden_states, vocab_weights, input_ids, temperature=1.0):
    logits = (hidden_states @ vocab_weights.t()) / temperature
    probs = logits.softmax(dim=-1)
    one_hot = torch.zeros_like(logits).scatter_(-1, input_ids.unsqueeze(-1), 1)
    dlogits = dlog_probs.unsqueeze(-1) * (one_hot - probs)
    log_probs = logits.log_softmax(dim=-1)
    entropy = torch.logsumexp(logits, dim=-1) - torch.sum(probs * logits, dim=-1)
    dlogits = dlogits + probs * (log_probs + entropy.unsqueeze(-1)) * (-dentropy.unsqueeze(-1))
    dlogits = dlogits / temperature
    return dlogits @ vocab_weights, dlogits.t() @ hidden_states


def _case(seed, shape=(3, 7), h=16, v=101):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) / 2
    ids = torch.randint(0, v, shape, generator=g)
    a, b = torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)
    return hidden, weight, ids, a, b


def _reference(hidden, weight, ids, a, b, temperature):
    h2, i1 = hidden.reshape(-1, hidden.shape[-1]), ids.reshape(-1)
    lp, ent = _verl_fwd(h2, weight, i1, temperature)
    dh, dw = _verl_bwd(a.reshape(-1), b.reshape(-1), h2, weight, i1, temperature)
    return lp.view(ids.shape), ent.view(ids.shape), dh.view(hidden.shape), dw


# Shapes verl passes: [B, T, H] (padded) and [1, N, H] / [N, H] (remove-padding); odd V and N.
@pytest.mark.parametrize(("seed", "shape", "temperature"), [(0, (3, 7), 1.0), (1, (1, 23), 0.7), (2, (19,), 1.3)])
def test_matches_verls_fused_linear_for_ppo_float64(seed, shape, temperature):
    hidden, weight, ids, a, b = _case(seed, shape)
    ref = _reference(hidden, weight, ids, a, b, temperature)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = FusedLinearForPPO()(hidden_states=h, vocab_weights=w, input_ids=ids, temperature=temperature)
    assert lp.shape == ids.shape and ent.shape == ids.shape
    (a * lp + b * ent).sum().backward()
    for ours, theirs in zip((lp, ent, h.grad, w.grad), ref, strict=True):
        assert torch.allclose(ours.detach(), theirs, rtol=1e-10, atol=1e-12)


def test_bad_reduction_and_ids_are_named_errors():
    hidden, weight, ids, _, _ = _case(3)
    with pytest.raises(ValueError, match="reduction must be 'none'"):
        linear_cross_entropy(hidden, weight, ids, 1.0, "mean")
    with pytest.raises(ValueError):
        linear_cross_entropy(hidden, weight, ids.masked_fill(ids == ids[0, 0], -100))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_rank(rank, world, port, case, queue):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        hidden, weight, ids, a, b, temperature = case
        rows = weight.shape[0] // world  # Megatron's even split; rank r holds rows r·rows …
        h = hidden.clone().requires_grad_()
        w = weight[rank * rows:(rank + 1) * rows].clone().requires_grad_()
        lp, ent = linear_cross_entropy(h, w, ids, temperature, "none", dist.group.WORLD)
        (a * lp + b * ent).sum().backward()
        # As numpy arrays: a tensor crosses the queue as a handle into this process's memory,
        # which is gone once the rank exits before the parent reads it.
        queue.put((rank, *(t.detach().numpy() for t in (lp, ent, h.grad, w.grad))))
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_over_a_process_group_matches_single_process():
    hidden, weight, ids, a, b = _case(4, v=102)
    temperature = 0.9
    ref = _reference(hidden, weight, ids, a, b, temperature)
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _port()
    procs = [ctx.Process(target=_tp_rank, args=(r, 2, port, (hidden, weight, ids, a, b, temperature), queue))
             for r in range(2)]
    for p in procs:
        p.start()
    outs = sorted((queue.get(timeout=120) for _ in procs), key=lambda o: o[0])
    outs = [(rank, *map(torch.from_numpy, arrays)) for rank, *arrays in outs]
    for p in procs:
        p.join(timeout=60)
    for rank, lp, ent, dh, dw in outs:
        assert torch.allclose(lp, ref[0], rtol=1e-10, atol=1e-12)
        assert torch.allclose(ent, ref[1], rtol=1e-10, atol=1e-12)
        assert torch.allclose(dh, ref[2], rtol=1e-10, atol=1e-12)  # all-reduced over the group
        assert torch.allclose(dw, ref[3][rank * 51:(rank + 1) * 51], rtol=1e-10, atol=1e-12)


def test_patch_verl_swaps_both_entry_points(monkeypatch):
    mods = {}
    for name in ("verl", "verl.utils", "verl.utils.experimental", "verl.utils.experimental.torch_functional",
                 "verl.utils.kernel", "verl.utils.kernel.linear_cross_entropy"):
        mods[name] = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, mods[name])
    mods["verl.utils.experimental.torch_functional"].FusedLinearForPPO = object
    mods["verl.utils.kernel.linear_cross_entropy"].linear_cross_entropy = None
    assert len(patch_verl()) == 2
    assert mods["verl.utils.experimental.torch_functional"].FusedLinearForPPO is FusedLinearForPPO
    assert mods["verl.utils.kernel.linear_cross_entropy"].linear_cross_entropy is linear_cross_entropy
