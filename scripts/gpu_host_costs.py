"""Host cost of single operations the pre-GEMM path uses (GPU only): microseconds a call."""

import time

import torch

from logitless.ops.contract import StatRequest, resolve_backend


def per_call(fn, n: int = 200) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t) / n
    torch.cuda.synchronize()
    return dt * 1e6


x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
t = torch.randint(0, 1000, (8192,), device="cuda")
small = torch.randn(8192, device="cuda")
cases = {
    "mem_get_info": lambda: torch.cuda.mem_get_info(),
    "memory_allocated": lambda: torch.cuda.memory_allocated(),
    "memory_reserved": lambda: torch.cuda.memory_reserved(),
    "empty 1 MiB": lambda: torch.empty(1 << 18, device="cuda"),
    "add small": lambda: small + 1.0,
    "vector_norm inf hidden": lambda: torch.linalg.vector_norm(x.reshape(-1), float("inf")),
    "aminmax targets": lambda: torch.aminmax(t),
    "(t<0)|(t>=V) any": lambda: ((t < 0) | (t >= 1000)).any(),
    "stack 4 + tolist (sync)": lambda: torch.stack([small[0], small[1], small[2], small[3]]).tolist(),
    "nonzero (sync)": lambda: (t > 10).nonzero(),
    "get_device_capability": lambda: torch.cuda.get_device_capability(),
    "resolve_backend gemm": lambda: resolve_backend("auto", x),
}
for name, fn in cases.items():
    try:
        print(f"{name:28s} {per_call(fn):8.1f} us")
    except Exception as e:
        print(f"{name:28s} failed: {type(e).__name__}: {e}")

# A statistics GEMM launch (the rollout's one Triton launch) at a bench shape, and its parts.
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from logitless.ops.gemm_backend.kernels import gemm_config, launch_forward  # noqa: E402
from logitless.ops.transform import LogitTransform  # noqa: E402
from logitless.ops.triton_shared.tile_gemm import TileOperands  # noqa: E402

w = torch.randn(128256, 4096, device="cuda", dtype=torch.bfloat16)
tgt = torch.randint(0, 128256, (8192,), device="cuda")
ops = TileOperands(x, w, None, tgt, LogitTransform())
cfg = gemm_config()
launches = {
    "launch_forward stats (async)": lambda: launch_forward(ops, StatRequest(), True, None, cfg),
    "TensorDescriptor.from_tensor": lambda: TensorDescriptor.from_tensor(w, [256, 64]),
    "torch.empty [501, 8192] f32": lambda: torch.empty((501, 8192), dtype=torch.float32, device="cuda"),
}
for name, fn in launches.items():
    print(f"{name:28s} {per_call(fn, n=20):8.1f} us")
