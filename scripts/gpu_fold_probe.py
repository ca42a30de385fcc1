"""Probe: the Triton statistics GEMM storing ``exp(z - ref)`` (bf16) or the centred fp16 tile, with
the target's logit taken where the kernel takes it, before ``e`` is formed, or after the sums (text
edits of ``gemm_backend/kernels.py``), timed round-robin against cuBLAS at one shape (GPU only).

    python3 scripts/gpu_fold_probe.py [SHAPE]     # default 6144:gemma2-2b
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import torch

from logitless.bench.cases import make_inputs, parse_shape
from logitless.ops.contract import StatRequest
from logitless.ops.transform import LogitTransform
from logitless.ops.triton_shared.tile_gemm import TileOperands

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from gpu_cute_gemm import bench

SRC = pathlib.Path(__file__).parents[1] / "src/logitless/ops/gemm_backend/kernels.py"
FIRST = "        if FOLD:\n            _target_logit("
LAST = "        if not FOLD:\n            _target_logit("
# Where the epilogue takes the target's logit: the kernel's choice (before e with the probability
# tile, after the sums with the centred one), and each order for both tiles.
VARIANTS = {
    "kernel": [],
    "zy after the sums": [(FIRST, "        if False:\n            _target_logit("),
                          (LAST, "        if True:\n            _target_logit(")],
    "zy before e": [(FIRST, "        if True:\n            _target_logit("),
                    (LAST, "        if False:\n            _target_logit(")],
}


def variant(name: str, edits):
    text = SRC.read_text()
    for old, new in edits:
        assert old in text, (name, old)
        text = text.replace(old, new, 1)
    path = pathlib.Path(f"/tmp/fold_probe_{abs(hash(name))}.py")
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"logitless.ops.gemm_backend._probe{abs(hash(name))}", path,
                                                  submodule_search_locations=None)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "logitless.ops.gemm_backend"
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    text = sys.argv[1] if len(sys.argv) > 1 else "6144:gemma2-2b"
    case = parse_shape(text)
    dev = torch.device("cuda")
    x = make_inputs(case, dev, torch.bfloat16)
    hidden = x.hidden.detach().reshape(-1, case.hidden_size).contiguous()
    ops = TileOperands(hidden, x.weight.detach().contiguous(), None, x.targets.reshape(-1).contiguous(),
                       LogitTransform())
    n, v = hidden.shape[0], case.vocab_size
    logits = torch.empty(n, v, device=dev, dtype=torch.bfloat16)
    centred = torch.empty(n, v, device=dev, dtype=torch.float16)
    probs = torch.empty(n, v, device=dev, dtype=torch.bfloat16)
    mods = {name: variant(name, edits) for name, edits in VARIANTS.items()}
    want = StatRequest(entropy=True)
    fns = {"cuBLAS": lambda: torch.mm(ops.hidden, ops.weight.t(), out=logits)}
    for name, mod in mods.items():
        fns[f"centred, {name}"] = lambda mod=mod: mod.launch_forward(ops, want, True, centred, mod.gemm_config())
        fns[f"fold, {name}"] = lambda mod=mod: mod.launch_forward(ops, want, True, probs, mod.gemm_config())
    tiles = []
    for mod in mods.values():
        mod.launch_forward(ops, want, True, probs, mod.gemm_config())
        tiles.append(probs.clone())
    print(f"fold tiles equal: {all(torch.equal(t, tiles[0]) for t in tiles)}")
    del tiles
    for r in range(2):
        ms = bench(fns, rounds=10)
        print(f"{text} round {r}: " + ", ".join(f"{k} {t:.3f} ms" for k, t in ms.items()), flush=True)


if __name__ == "__main__":
    main()
