"""liger-cute-kernels' native fused linear cross-entropy beside logitless's, in one process (GPU only).

``liger-cute-kernels`` 0.8.5 (CUTLASS + NVSHMEM, loaded through TVM FFI) provides Liger's
tensor-parallel fused scaled linear cross-entropy; here it runs at TP = 1 (a one-rank NCCL group and
a one-PE NVSHMEM job) on the bench's inputs, against the bench's cuBLAS floor (three GEMMs) and
logitless's cross-entropy rows in the same process, each timed as the bench times it. Accuracy: the
loss's and both gradients' relative errors against float64 materialized logits.

Its wheel needs CUDA 12's runtime and NVSHMEM (cu12), 210 MB unpacked: ``scripts/pack_liger_cute_kernels.sh``
packs what it loads into ``.lck/site.tar.xz`` (about 49 MB: one transfer to the GPU machine). There:

    mkdir -p /tmp/lck && tar -xJf .lck/site.tar.xz -C /tmp/lck
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/liger_kernel-0.8.5-py3-none-any.whl
    PYTHONPATH=/tmp/lck:/tmp/site:$PWD/src LD_LIBRARY_PATH=/tmp/lck/liger_cute_kernels:/tmp/lck/tvm_ffi/lib \\
        NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_DISABLE_NVLS=1 \\
        python3 scripts/gpu_liger_cute_kernels.py OUT.json 8k:llama3-8b 8k:gemma2-2b

(one PE needs no remote transport, and NVLink multicast stays off on these machines).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from logitless.bench.cases import make_inputs, parse_shape
from logitless.bench.competitors import Prepared, rows_of
from logitless.bench.timing import time_step


def _native(x, group) -> Prepared:
    from liger_kernel.ops.cute.fused_linear_scaled_cross_entropy_tp import (
        LigerFusedLinearScaledCrossEntropyNativeTPFunction as native,
    )

    h2, y = x.hidden.reshape(-1, x.hidden.shape[-1]), x.targets.reshape(-1)

    def step() -> dict:
        # (input, weight, target, vocab_start, temperature, ignore_index, tiles_per_reduce, return_entropy, group)
        loss = native.apply(h2, x.weight, y, 0, 1.0, -100, 1, False, group).mean()
        loss.backward()
        return {"loss": loss.detach()}

    return Prepared(step)


def _errors(x, prepared: Prepared) -> dict:
    """Relative errors of the loss and gradients of one call against float64 materialized logits."""
    h = x.hidden.detach().double().reshape(-1, x.hidden.shape[-1]).requires_grad_()
    w = x.weight.detach().double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(h @ w.t(), x.targets.reshape(-1))
    ref.backward()
    x.hidden.grad = x.weight.grad = None
    loss = prepared.step()["loss"]
    return {"loss_rel": _rel(loss, ref), "grad_hidden_rel": _rel(x.hidden.grad.reshape(h.shape), h.grad),
            "grad_weight_rel": _rel(x.weight.grad, w.grad)}


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


def _case(case, group, dev: torch.device) -> dict:
    """The floor, logitless's fused cross-entropy and the native kernel on one shape."""
    ours = {r.name: r for r in rows_of("ce")}
    x = make_inputs(case, dev, torch.bfloat16)

    def reset() -> None:
        x.hidden.grad = x.weight.grad = None

    rows = {"floor": ours["floor"].prepare(x, "auto"),
            "logitless-fused": ours["logitless-fused"].prepare(x, "auto"),
            "liger-cute-kernels-tp1": _native(x, group)}
    record = {"shape": case.label, "device": torch.cuda.get_device_name(dev), "rows": {}}
    for name, prepared in rows.items():
        for _ in range(2):
            reset()
            prepared.step()
        ms = time_step(prepared.step, reset, dev, min_reps=10).median_ms
        record["rows"][name] = {"time_ms": ms} | ({} if name == "floor" else _errors(x, prepared))
        reset()
        torch.cuda.empty_cache()
    floor = record["rows"]["floor"]["time_ms"]
    for name, r in record["rows"].items():
        r["ratio_to_floor"] = r["time_ms"] / floor
        print(f"{case.label:16s} {name:24s} {r['time_ms']:8.2f} ms {r['ratio_to_floor']:5.2f}x  " +
              " ".join(f"{k}={v:.1e}" for k, v in r.items() if k.endswith("_rel")))
    return record


def main() -> None:
    out_path, shapes = sys.argv[1], [parse_shape(s) for s in sys.argv[2:]]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
    group = dist.group.WORLD
    import liger_cute_kernels as lck

    # One reservation for every shape: its capacity cannot grow after the first configure.
    lck.configure(process_groups={"tp": group}, bootstrap_group=group, device=dev,
                  flsce=lck.FusedLinearCrossEntropyConfig(
                      max_tokens=max(c.n_tokens for c in shapes), hidden_size=max(c.hidden_size for c in shapes),
                      local_vocab_size=max(c.vocab_size for c in shapes), group="tp"))
    records = [_case(case, group, dev) for case in shapes]
    with open(out_path, "w") as f:
        json.dump(records, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
