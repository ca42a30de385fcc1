"""GPU check of the Triton backend: correctness at real shapes, then timings.

Usage (on a CUDA machine, from the repository root)::

    python scripts/gpu_triton_check.py [--n 8192] [--hidden 4096] [--vocab 128256] [--quick]

1. Correctness in bf16 against the torch backend (fp32 logits, the reference of the kernels):
   recompute (``vocab_stats``) and fused (``fused_objective``) forward statistics and gradients,
   with and without a transform, for both tile dtypes.
2. Timings, ``triton.testing.do_bench`` medians in ms: the three bare bf16 cuBLAS GEMMs (the
   floor), the fused path fwd+bwd, the recompute path fwd+bwd, rollout log-probs + entropy vs
   one GEMM, and the two row kernels alone.

Logits are realistic rather than uniform: a Gaussian background (std 2) plus the target boosted
by 10-18 nats, which gives entropies of a few nats. Every section catches its own errors so one
failure does not hide the rest.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch

from logitless import PassOptions

ROWS: list[tuple[str, float, str]] = []
# --dry-run: tiny shapes on CPU under TRITON_INTERPRET=1, one timed call per row (script check only).
DEV = {"device": "cuda", "dry": False}


def section(fn):
    def run(*a, **k):
        print(f"\n== {fn.__name__} ==", flush=True)
        try:
            fn(*a, **k)
        except Exception:
            traceback.print_exc()
            print(f"!! {fn.__name__} failed", flush=True)
    return run


def make_inputs(n: int, hidden: int, vocab: int, seed: int = 0):
    dev = DEV["device"]
    g = torch.Generator(device=dev).manual_seed(seed)
    sigma = 2.0
    w = (torch.randn(vocab, hidden, device=dev, generator=g) * (sigma / hidden**0.5)).to(torch.bfloat16)
    y = torch.randint(0, vocab, (n,), device=dev, generator=g)
    boost = 10.0 + 8.0 * torch.rand(n, device=dev, generator=g)
    wy = w[y].float()
    h = torch.randn(n, hidden, device=dev, generator=g) + boost[:, None] * wy / (wy * wy).sum(1, keepdim=True)
    return h.to(torch.bfloat16), w, y


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def set_tile(tile: str) -> None:
    os.environ["LOGITLESS_TRITON_LOGITS"] = tile


@section
def check_correctness(h, w, y, n_check: int):
    from logitless.ops import fused, gemm, torch_backend, triton_backend
    from logitless.ops.transform import LogitTransform
    from logitless.ops.vocab_stats import vocab_stats

    if not DEV["dry"]:
        print(f"cuda out_dtype GEMMs usable: {gemm.cuda_out_dtype_ok()}")
    h, y = h[:n_check], y[:n_check]
    for tile in ("input", "fp32"):
        set_tile(tile)
        for kw in ({}, {"temperature": 0.7, "softcap": 30.0}):
            res = {}
            for impl in ("torch", "triton"):
                hh = h.detach().clone().requires_grad_()
                ww = w.detach().clone().requires_grad_()
                st = vocab_stats(hh, ww, y, **kw, options=PassOptions(impl=impl))
                (-st.logp.sum() + 0.01 * st.entropy.sum()).backward()
                res[impl] = (st.logp.detach(), st.entropy.detach(), hh.grad, ww.grad)
            a, b = res["triton"], res["torch"]
            print(f"recompute tile={tile:5s} {kw or 'identity'}: max|dlogp|={(a[0]-b[0]).abs().max().item():.3e} "
                  f"max|dent|={(a[1]-b[1]).abs().max().item():.3e} mean ent={b[1].mean().item():.2f} "
                  f"rel dh={rel(a[2], b[2]):.2e} rel dW={rel(a[3], b[3]):.2e}")
        res = {}
        for name, be in (("torch", torch_backend), ("triton", triton_backend)):
            hh = h.detach().clone().requires_grad_()
            ww = w.detach().clone().requires_grad_()
            loss, logp, ent, _ = fused.fused_objective(
                hh, ww, None, y, LogitTransform(), lambda sl, lp, en: ((-lp + 0.01 * en).sum(), None), cuts=None,
                want_entropy=True, chunk_bytes=None, backend=be)
            loss.backward()
            res[name] = (logp, ent, hh.grad, ww.grad, loss.detach())
        a, b = res["triton"], res["torch"]
        print(f"fused     tile={tile:5s}: max|dlogp|={(a[0]-b[0]).abs().max().item():.3e} "
              f"max|dent|={(a[1]-b[1]).abs().max().item():.3e} loss {a[4].item():.4f} vs {b[4].item():.4f} "
              f"rel dh={rel(a[2], b[2]):.2e} rel dW={rel(a[3], b[3]):.2e}")
    os.environ.pop("LOGITLESS_TRITON_LOGITS", None)


def bench(name: str, fn, floor: float | None = None, note: str = "") -> float:
    import time

    import triton.testing

    fn()
    if DEV["dry"]:
        t0 = time.perf_counter()
        fn()
        ms = (time.perf_counter() - t0) * 1e3
    else:
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(fn, warmup=25, rep=500, return_mode="median")
    ROWS.append((name, ms, note if floor is None else f"{ms / floor:.3f}x {note}"))
    print(f"{name:58s} {ms:9.3f} ms  {ROWS[-1][2]}", flush=True)
    return ms


def _recording(backend):
    """The backend module with chunk_forward wrapped to record the chunk/tile shapes used."""
    seen: list = []

    def chunk_forward(hidden, weight, *a, **k):
        plan = a[3]
        seen.append((hidden.shape[0], plan.vocab_block))
        return backend.chunk_forward(hidden, weight, *a, **k)

    return types.SimpleNamespace(chunk_forward=chunk_forward, chunk_backward=backend.chunk_backward), seen


@section
def timings(h, w, y, quick: bool):
    from logitless.ops import fused, gemm, torch_backend, triton_backend
    from logitless.ops.plan import ChunkPlan, workspace_per_element
    from logitless.ops.transform import LogitTransform
    from logitless.ops.triton_kernels import kernel_config, launch_dlogits, launch_stats
    from logitless.ops.vocab_stats import _RecomputeFn, token_logprobs, vocab_stats

    n, hid = h.shape
    vocab = w.shape[0]
    tr = LogitTransform()
    torch_per = workspace_per_element(torch.float32, torch.bfloat16, "torch")
    dev = h.device
    print(f"N={n} H={hid} V={vocab} bf16")

    dy = torch.randn(n, vocab, device=dev, dtype=torch.bfloat16) * 1e-3
    t1 = bench("GEMM logits h@W^T (bf16 out)", lambda: torch.mm(h, w.t()))
    t2 = bench("GEMM d hidden dy@W (bf16 out)", lambda: torch.mm(dy, w))
    t3 = bench("GEMM d weight dy^T@h (bf16 out)", lambda: torch.mm(dy.t(), h))
    floor3 = t1 + t2 + t3
    ROWS.append(("3-GEMM floor (sum)", floor3, "1.000x"))
    print(f"{'3-GEMM floor (sum)':58s} {floor3:9.3f} ms")
    gw = torch.zeros(vocab, hid, device=dev)
    if not DEV["dry"] and gemm.cuda_out_dtype_ok():
        bench("GEMM d weight fp32 accumulate (addmm out_dtype)",
              lambda: torch.addmm(gw, dy.t(), h, out_dtype=torch.float32, out=gw), t3, "vs bf16 dW GEMM")
    dy = None  # free the 2 GiB before the next section

    tile = torch.mm(h, w.t())
    m = torch.empty(n, device=dev)
    se, sez, zy = torch.empty_like(m), torch.empty_like(m), torch.empty_like(m)
    default = kernel_config(vocab)

    def stats(cfg):
        def run():
            m.fill_(-torch.inf)
            se.zero_()
            sez.zero_()
            launch_stats(tile, None, y, 0, tr, m, se, sez, zy, cfg)
        return run

    gbytes = tile.numel() * tile.element_size() / 1e6  # per ms -> GB/s
    sweep = [(1, 2048, 8)] if DEV["dry"] else [
        (r, bv, wp) for r in (1, 2, 4, 8) for bv in (512, 1024, 2048) for wp in (4, 8) if r * bv <= 8192]
    best_stats = None
    for r, bv, wp in sweep:
        cfg = dataclasses.replace(default, stats_rows=r, stats_block_v=bv, stats_warps=wp)
        ms = bench(f"kernel stats rows={r} block_v={bv} warps={wp}", stats(cfg))
        ROWS[-1] = (ROWS[-1][0], ms, f"{gbytes / ms:.0f} GB/s")
        if best_stats is None or ms < best_stats[0]:
            best_stats = (ms, cfg)
    ms = bench(f"kernel stats DEFAULT rows={default.stats_rows} block_v={default.stats_block_v} "
               f"warps={default.stats_warps}", stats(default))
    ROWS[-1] = (ROWS[-1][0], ms, f"{gbytes / ms:.0f} GB/s")
    lse = m + se.log()
    spz = sez / se
    g = -torch.ones(n, device=dev)
    coef = -g
    scratch = tile.clone()
    best_grad = None
    for bv, wp in ([(2048, 8)] if DEV["dry"] else [(1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16)]):
        cfg = dataclasses.replace(default, grad_block_v=bv, grad_warps=wp)
        ms = bench(f"kernel dlogits block_v={bv} warps={wp}",
                   lambda cfg=cfg: launch_dlogits(tile, scratch, None, y, 0, tr, lse, spz, coef, g, g * 0.01, cfg))
        ROWS[-1] = (ROWS[-1][0], ms, f"{2 * gbytes / ms:.0f} GB/s (read + write)")
        if best_grad is None or ms < best_grad[0]:
            best_grad = (ms, cfg)
    tile = scratch = None
    best = dataclasses.replace(best_stats[1], grad_block_v=best_grad[1].grad_block_v,
                               grad_warps=best_grad[1].grad_warps)
    print(f"best swept config (used below): {best}")

    def swept_config(vocab_block):
        cfg = kernel_config(vocab_block)
        return dataclasses.replace(best, tile=cfg.tile)

    triton_backend.kernel_config = swept_config  # the end-to-end rows run the sweep's winner

    gw = None
    zeros_ms = bench("fused.py overhead: torch.zeros(V, H) fp32 grad_weight",
                     lambda: torch.zeros(vocab, hid, device=dev))
    gw = torch.zeros(vocab, hid, device=dev)
    one = torch.ones((), device=dev)
    cast_ms = bench("fused.py overhead: (grad_weight * g_loss).to(bf16)", lambda: (gw * one).to(torch.bfloat16))
    bench("  vs grad_weight.to(bf16) alone", lambda: gw.to(torch.bfloat16))
    bench("validate: isfinite(weight).all()", lambda: torch.isfinite(w).all())
    print(f"   -> fused.py overhead outside the backend ~{zeros_ms + cast_ms:.2f} ms "
          f"= {(zeros_ms + cast_ms) / floor3:.3f} of the floor")
    gw = None

    def objective(sl, lp, en):
        return (-lp.sum() if en is None else (-lp + 0.01 * en).sum()), None

    def fused_step(backend, chunk_bytes, want_entropy):
        hh = h.detach().requires_grad_()
        ww = w.detach().requires_grad_()

        def step():
            hh.grad = ww.grad = None
            loss, *_ = fused.fused_objective(hh, ww, None, y, tr, objective, cuts=None, want_entropy=want_entropy,
                                             chunk_bytes=chunk_bytes, backend=backend)
            loss.backward()
        return step

    cases = [("input", 2048), ("input", 4096), ("input", n)]
    if not quick:
        cases += [("fp32", 4096), ("fp32", n)]
    for tile_mode, tokens in cases:
        set_tile(tile_mode)
        if True:
            rec, seen = _recording(triton_backend)
            # fused.py sizes chunks with the torch backend's bytes per element; this budget makes
            # its plan give `tokens`-token chunks (the recorded shapes are printed).
            cb = tokens * vocab * torch_per
            for ent in (False, True):
                seen.clear()
                ms = bench(f"fused triton tile={tile_mode} chunk={tokens} entropy={ent}",
                           fused_step(rec, cb, ent), floor3)
                ROWS[-1] = (ROWS[-1][0], ms, f"{ms / floor3:.3f}x; (tokens, vocab_block) {sorted(set(seen))}")
    os.environ.pop("LOGITLESS_TRITON_LOGITS", None)
    if not quick:
        bench("fused torch backend, default 512 MiB budget", fused_step(torch_backend, None, False), floor3)

    floor4 = floor3 + t1

    def recompute_public(chunk_bytes):
        hh = h.detach().requires_grad_()
        ww = w.detach().requires_grad_()

        def step():
            hh.grad = ww.grad = None
            st = vocab_stats(hh, ww, y, entropy=True, options=PassOptions(impl="triton", chunk_bytes=chunk_bytes))
            (-st.logp.sum() + 0.01 * st.entropy.sum()).backward()
        return step

    def recompute_plan(plan):
        hh = h.detach().requires_grad_()
        ww = w.detach().requires_grad_()

        def step():
            hh.grad = ww.grad = None
            _lse, logp, ent = _RecomputeFn.apply(hh, ww, None, y, tr, plan, True, triton_backend)
            (-logp.sum() + 0.01 * ent.sum()).backward()
        return step

    ms = bench("recompute vocab_stats, chunk_bytes=2048 rows (torch formula)",
               recompute_public(2048 * vocab * torch_per), floor3)
    ROWS[-1] = (ROWS[-1][0], ms, f"{ms / floor3:.3f}x of 3 GEMMs, {ms / floor4:.3f}x of 4 GEMMs")
    for mib in (64, 256):
        plan = ChunkPlan.make(n, vocab, mib * 2**20, torch.float32, torch.bfloat16, backend="triton")
        ms = bench(f"recompute triton plan {mib} MiB ({plan.token_chunk}x{plan.vocab_block})",
                   recompute_plan(plan), floor3)
        ROWS[-1] = (ROWS[-1][0], ms, f"{ms / floor3:.3f}x of 3 GEMMs, {ms / floor4:.3f}x of 4 GEMMs")

    t1 = bench("GEMM logits h@W^T again (clock drift check)", lambda: torch.mm(h, w.t()))
    for label, cb in (("default budget", None), ("2048-row chunks", 2048 * vocab * torch_per),
                      ("one chunk", n * vocab * torch_per)):
        bench(f"rollout token_logprobs+entropy, {label}",
              lambda cb=cb: token_logprobs(h, w, y, return_entropy=True,
                                           options=PassOptions(impl="triton", chunk_bytes=cb)), t1,
              "vs 1 GEMM")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--n-check", type=int, default=2048)
    ap.add_argument("--quick", action="store_true", help="one tile dtype, fewer timing rows")
    ap.add_argument("--dry-run", action="store_true", help="CPU + TRITON_INTERPRET=1 at tiny shapes")
    args = ap.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        DEV.update(device="cpu", dry=True)
    elif not torch.cuda.is_available():
        sys.exit("gpu_triton_check.py needs CUDA")
    import triton

    name = "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name()
    print(f"torch {torch.__version__} triton {triton.__version__} {name}")
    h, w, y = make_inputs(args.n, args.hidden, args.vocab)
    check_correctness(h, w, y, args.n_check)
    timings(h, w, y, args.quick)
    print("\n| case | ms | ratio |\n|---|---|---|")
    for name, ms, note in ROWS:
        print(f"| {name} | {ms:.3f} | {note} |")


if __name__ == "__main__":
    main()
