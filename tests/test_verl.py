"""The verl adapter against the installed verl package (``pip install --no-deps verl==0.9.1``):
its ``FusedLinearForPPO`` torch reference (``verl/utils/experimental/torch_functional.py``,
loaded from the installed file, see ``framework_sources``) is the oracle for log-probs, entropy
and both gradients, single-process and vocabulary-parallel over 2 gloo ranks; call signatures
are compared with verl's ``FusedLinearForPPO`` and ``linear_cross_entropy``
(``verl/utils/kernel/linear_cross_entropy.py``). verl's Triton ``linear_cross_entropy`` asserts
CUDA tensors: its comparison is a ``cuda`` test."""

from __future__ import annotations

import inspect
import os
import socket
import sys
import types

import pytest
import torch
import torch.multiprocessing as mp
from framework_sources import module_file, package_modules

from logitless.integrations.verl import FusedLinearForPPO, linear_cross_entropy, patch_verl

TORCH_FUNCTIONAL = "verl/utils/experimental/torch_functional.py"


def _case(seed, shape=(3, 7), h=16, v=101, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, h, generator=g, dtype=dtype)
    weight = torch.randn(v, h, generator=g, dtype=dtype) / 2
    ids = torch.randint(0, v, shape, generator=g)
    a, b = torch.randn(shape, generator=g, dtype=dtype), torch.randn(shape, generator=g, dtype=dtype)
    return hidden, weight, ids, a, b


def _run(module, hidden, weight, ids, a, b, temperature, **kwargs):
    """log-probs, entropy, d hidden, d weight of ``sum(a·log_probs + b·entropy)``."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = module(**kwargs)(hidden_states=h, vocab_weights=w, input_ids=ids, temperature=temperature)
    assert lp.shape == ids.shape and ent.shape == ids.shape
    (a * lp + b * ent).sum().backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def _reference(hidden, weight, ids, a, b, temperature, chunk_size=512):
    """verl's own FusedLinearForPPO (torch backend), its fp32 upcasts run in float64."""
    verl = module_file("verl", TORCH_FUNCTIONAL, widened=True)
    return _run(verl.FusedLinearForPPO, hidden, weight, ids, a, b, temperature, chunk_size=chunk_size)


# Shapes verl passes: [B, T, H] (padded) and [1, N, H] / [N, H] (remove-padding); odd V and N;
# a chunk size below N so that verl's chunk loop runs more than once.
@pytest.mark.parametrize(
    ("shape", "temperature", "chunk_size"), [((3, 7), 1.0, 512), ((1, 23), 0.7, 5), ((19,), 1.3, 4)]
)
def test_matches_verls_fused_linear_for_ppo_float64(seed, shape, temperature, chunk_size):
    hidden, weight, ids, a, b = _case(seed, shape)
    ref = _reference(hidden, weight, ids, a, b, temperature, chunk_size)
    ours = _run(FusedLinearForPPO, hidden, weight, ids, a, b, temperature, chunk_size=chunk_size)
    for x, y in zip(ours, ref, strict=True):
        assert x.dtype == torch.float64
        assert torch.allclose(x, y, rtol=1e-10, atol=1e-12)


def test_fp32_error_within_verls(seed):
    """On fp32 inputs, unmodified verl (fp32 logits) and logitless (fp32 statistics) against
    verl in float64: logitless's error is bounded by verl's own plus a rounding margin."""
    hidden, weight, ids, a, b = _case(seed, (2, 9), h=32, v=301)
    temperature = 0.8
    ref = _reference(hidden, weight, ids, a, b, temperature)
    f32 = [t.float() for t in (hidden, weight)], ids, [t.float() for t in (a, b)]
    verl = _run(module_file("verl", TORCH_FUNCTIONAL).FusedLinearForPPO, *f32[0], ids, *f32[2], temperature)
    ours = _run(FusedLinearForPPO, *f32[0], ids, *f32[2], temperature)
    for x, y, r in zip(ours, verl, ref, strict=True):
        assert x.dtype == torch.float32
        err_ours, err_verl = (x.double() - r).abs().max(), (y.double() - r).abs().max()
        assert err_ours <= err_verl + 1e-5 * r.abs().max(), (err_ours, err_verl)


def _params(fn, skip=0):
    return [(p.name, p.default) for p in list(inspect.signature(fn).parameters.values())[skip:]]


def test_call_signatures_are_verls():
    verl = module_file("verl", TORCH_FUNCTIONAL)
    assert _params(FusedLinearForPPO.__init__)[: len(_params(verl.FusedLinearForPPO.__init__))] == _params(
        verl.FusedLinearForPPO.__init__
    )
    assert _params(FusedLinearForPPO.forward) == _params(verl.FusedLinearForPPO.forward)
    lce = module_file("verl", "verl/utils/kernel/linear_cross_entropy.py")
    # verl's linear_cross_entropy is LinearCrossEntropy.apply: forward's parameters after ctx.
    assert _params(linear_cross_entropy)[:6] == _params(lce.LinearCrossEntropy.forward, skip=1)
    # verl builds the module as FusedLinearForPPO(impl_backend=...) and rejects other backends.
    for cls in (FusedLinearForPPO, verl.FusedLinearForPPO):
        assert cls(impl_backend="liger").impl_backend == "liger"
        with pytest.raises(ValueError, match="Unsupported FusedLinearForPPO backend"):
            cls(impl_backend="triton")


def test_int32_ids_as_verl_takes_them(seed):
    hidden, weight, ids, a, b = _case(seed, (2, 5))
    ref = _reference(hidden, weight, ids, a, b, 1.0)
    ours = _run(FusedLinearForPPO, hidden, weight, ids.int(), a, b, 1.0)
    for x, y in zip(ours, ref, strict=True):
        assert torch.allclose(x, y, rtol=1e-10, atol=1e-12)


@pytest.mark.cuda
def test_matches_verls_triton_kernel_on_cuda(seed):
    """verl's Triton linear_cross_entropy and logitless against float64, bf16 inputs."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    hidden, weight, ids, a, b = _case(seed, (4, 512), h=1024, v=32000)
    dev = [t.cuda() for t in (hidden, weight, ids, a, b)]
    ref = [r.cpu() for r in _reference(*dev, 0.9)]
    with package_modules("verl.utils.kernel.linear_cross_entropy") as (lce,):
        for fn in (lce.linear_cross_entropy, linear_cross_entropy):
            h = dev[0].bfloat16().requires_grad_()
            w = dev[1].bfloat16().requires_grad_()
            lp, ent = fn(h, w, dev[2], 0.9, "none")
            (dev[3] * lp + dev[4] * ent).sum().backward()
            errs = [
                (x.double().cpu() - r).abs().max().item() for x, r in zip((lp, ent, h.grad, w.grad), ref, strict=True)
            ]
            print(fn.__module__, "max |err| vs float64 (logp, entropy, dh, dw):", errs)
            assert errs[0] < 0.1 and errs[1] < 0.1


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
        w = weight[rank * rows : (rank + 1) * rows].clone().requires_grad_()
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
    procs = [
        ctx.Process(target=_tp_rank, args=(r, 2, port, (hidden, weight, ids, a, b, temperature), queue))
        for r in range(2)
    ]
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
        assert torch.allclose(dw, ref[3][rank * 51 : (rank + 1) * 51], rtol=1e-10, atol=1e-12)


def test_patch_verl_swaps_both_entry_points(monkeypatch):
    mods = {}
    names = (
        "verl",
        "verl.utils",
        "verl.utils.experimental",
        "verl.utils.experimental.torch_functional",
        "verl.utils.kernel",
        "verl.utils.kernel.linear_cross_entropy",
        "verl.models.mcore.model_forward_fused",
    )
    for name in names:
        mods[name] = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, mods[name])
    mods["verl.utils.experimental.torch_functional"].FusedLinearForPPO = object
    mods["verl.utils.kernel.linear_cross_entropy"].linear_cross_entropy = None
    mods["verl.models.mcore.model_forward_fused"].linear_cross_entropy = None  # bound at its import
    assert len(patch_verl()) == 3
    assert mods["verl.utils.experimental.torch_functional"].FusedLinearForPPO is FusedLinearForPPO
    assert mods["verl.utils.kernel.linear_cross_entropy"].linear_cross_entropy is linear_cross_entropy
    assert mods["verl.models.mcore.model_forward_fused"].linear_cross_entropy is linear_cross_entropy
