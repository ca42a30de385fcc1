"""GPU check of the flash backend (``impl="flash"``): correctness against the Triton backend, then
timings and peak memory.

Usage (on a CUDA machine, from the repository root)::

    python scripts/gpu_flash_check.py [--n 8192] [--hidden 4096] [--vocab 128256] [--skip-check]
    python scripts/gpu_flash_check.py --dry-run   # tiny shapes on CPU under TRITON_INTERPRET=1

1. Correctness in bf16, flash vs the Triton backend (cuBLAS fp32 logits), recompute mode
   (``vocab_stats`` + backward of ``-logp.sum() + 0.01 * entropy.sum()``), plain and with
   ``temperature``/``softcap``, unfiltered and filtered: max abs differences of ``logp``, ``lse``,
   ``entropy``, ``d hidden``, ``d weight`` (and relative norms). How many 128 x 128 tiles the
   filter can skip is estimated on the first rows.
2. Timings (``triton.testing.do_bench`` medians, ms): the flash forward kernel alone vs the
   cuBLAS logits GEMM ``h @ W.T`` (bf16 out); the flash backward kernel alone; fwd+bwd of the
   public path vs the 3-GEMM floor (logits, ``dy @ W``, ``dy.T @ h``, bf16 cuBLAS) and vs
   ``impl="triton"``, with and without filtering.
3. Peak memory beyond the inputs (``torch.cuda.max_memory_allocated`` minus what was allocated
   before the step) of one fwd+bwd step and of one rollout forward, flash vs triton.

Logits are realistic rather than uniform: a Gaussian background (std 2) plus the target boosted
by 10-18 nats (entropies of a few nats). Every row catches its own errors and prints them, so
one failure does not hide the rest; a markdown table closes the output.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch

from logitless import PassOptions

ROWS: list[tuple[str, str, str]] = []  # (case, value, note)
DEV = {"device": "cuda", "dry": False}


def row(name: str, value: str, note: str = "") -> None:
    ROWS.append((name, value, note))
    print(f"{name:64s} {value:>12s}  {note}", flush=True)


def guarded(name: str, fn) -> None:
    try:
        fn()
    except Exception as exc:  # a GPU script: report and go on
        traceback.print_exc()
        row(name, "error", f"{type(exc).__name__}: {str(exc)[:120]}")


def make_inputs(n: int, hidden: int, vocab: int, seed: int = 0, sigma: float = 2.0):
    """``sigma``: std of the background logits (2: entropies of a few nats; 0.5: a peaked head
    whose off-target probabilities are ~1e-6, what gradient filtering is for)."""
    dev = DEV["device"]
    g = torch.Generator(device=dev).manual_seed(seed)
    w = (torch.randn(vocab, hidden, device=dev, generator=g) * (sigma / hidden**0.5)).to(torch.bfloat16)
    y = torch.randint(0, vocab, (n,), device=dev, generator=g)
    boost = 10.0 + 8.0 * torch.rand(n, device=dev, generator=g)
    wy = w[y].float()
    h = torch.randn(n, hidden, device=dev, generator=g) + boost[:, None] * wy / (wy * wy).sum(1, keepdim=True)
    return h.to(torch.bfloat16), w, y


def set_filter(on: bool) -> None:
    """Flip ``LOGITLESS_FLASH_FILTER`` and rebuild the (read-once) flash config."""
    from logitless.ops.flash_kernels import flash_config

    os.environ["LOGITLESS_FLASH_FILTER"] = "1" if on else "0"
    flash_config.cache_clear()


def sync() -> None:
    if not DEV["dry"]:
        torch.cuda.synchronize()


def bench_ms(fn) -> float:
    fn()
    if DEV["dry"]:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    sync()
    return triton.testing.do_bench(fn, warmup=10, rep=200, return_mode="median")


def timed(name: str, fn, ref: float | None = None, ref_name: str = "") -> float | None:
    out: list[float] = []

    def run():
        ms = bench_ms(fn)
        out.append(ms)
        row(name, f"{ms:.3f} ms", f"{ms / ref:.3f}x {ref_name}" if ref else "")

    guarded(name, run)
    return out[0] if out else None


def step_fn(h, w, y, impl: str, **kw):
    """One recompute fwd+bwd through the public API; grads dropped before each call."""
    from logitless.ops.vocab_stats import vocab_stats

    hh = h.detach().clone().requires_grad_()
    ww = w.detach().clone().requires_grad_()

    def step():
        hh.grad = ww.grad = None
        st = vocab_stats(hh, ww, y, **kw, options=PassOptions(impl=impl))
        (-st.logp.sum() + 0.01 * st.entropy.sum()).backward()
        return st, hh, ww

    return step


# ---------------------------------------------------------------------------------------------


def check_correctness(h, w, y) -> None:
    def max_abs(a, b):
        return (a.float() - b.float()).abs().max().item()

    def rel(a, b):
        a, b = a.float(), b.float()
        return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()

    for kw in ({}, {"temperature": 0.7, "softcap": 30.0}):
        res = {}
        for label, impl, filt in (("triton", "triton", False), ("flash", "flash", False),
                                  ("flash+filter", "flash", True)):
            set_filter(filt)
            st, hh, ww = step_fn(h, w, y, impl, **kw)()
            res[label] = (st.logp.detach(), st.lse.detach(), st.entropy.detach(), hh.grad, ww.grad)
        set_filter(False)
        ref = res["triton"]
        for label in ("flash", "flash+filter"):
            a = res[label]
            d = {k: max_abs(x, r) for k, x, r in zip(("logp", "lse", "entropy"), a[:3], ref[:3], strict=True)}
            row(f"check {label} vs triton {kw or 'identity'}: stats", f"{max(d.values()):.2e}",
                " ".join(f"max|d {k}|={v:.2e}" for k, v in d.items()))
            row(f"check {label} vs triton {kw or 'identity'}: d hidden",
                f"{max_abs(a[3], ref[3]):.2e}", f"max|ref| {ref[3].float().abs().max().item():.2e}, "
                f"rel norm {rel(a[3], ref[3]):.2e}")
            row(f"check {label} vs triton {kw or 'identity'}: d weight",
                f"{max_abs(a[4], ref[4]):.2e}", f"max|ref| {ref[4].float().abs().max().item():.2e}, "
                f"rel norm {rel(a[4], ref[4]):.2e}")
        row(f"check mean entropy {kw or 'identity'}", f"{ref[2].mean().item():.3f}", "nats (triton)")


def skippable_tiles(h, w, y, rows: int, block: int, label: str = "") -> None:
    """Fraction of ``block x block`` tiles of the first ``rows`` rows with every p < finfo.eps/32
    and no target (what the filter may skip for cross-entropy)."""
    h, y = h[:rows], y[:rows]
    n, vocab = h.shape[0], w.shape[0]
    p = torch.softmax(h.float() @ w.float().t(), dim=1)
    eps = torch.finfo(torch.bfloat16).eps / 32
    nb, vb = -(-n // block), -(-vocab // block)
    pad = torch.zeros(nb * block, vb * block, device=p.device)
    pad[:n, :vocab] = p
    tile_max = pad.view(nb, block, vb, block).amax(dim=(1, 3))
    has_target = torch.zeros(nb, vb, dtype=torch.bool, device=p.device)
    has_target[torch.arange(n, device=p.device) // block, y // block] = True
    frac = ((tile_max < eps) & ~has_target).float().mean().item()
    row(f"filter: skippable {block}x{block} tiles (first {n} rows, CE){label}", f"{100 * frac:.1f} %")


def peaked_filter(n: int, hidden: int, vocab: int) -> None:
    """Gradient filtering where it applies: a peaked head (background std 0.5)."""
    from logitless.ops import flash_backend
    from logitless.ops.flash_kernels import flash_config, launch_grad
    from logitless.ops.plan import ChunkPlan
    from logitless.ops.transform import LogitTransform

    h, w, y = make_inputs(n, hidden, vocab, seed=1, sigma=0.5)
    skippable_tiles(h, w, y, min(n, 1024), 128, ", peaked head")
    tr = LogitTransform()
    plan = ChunkPlan(token_chunk=n, vocab_block=vocab, keep_logits=False)
    part, _ = flash_backend.chunk_forward(h, w, None, y, tr, plan, torch.float32, True, False)
    lse, _, sum_pz = part.finalize()
    g_logp = -torch.ones(n, device=h.device)
    g_ent = torch.full((n,), 0.01, device=h.device)
    grads = {}
    for filt in (False, True):
        set_filter(filt)
        cfg = flash_config()
        gh = torch.zeros(n, hidden, device=h.device)
        gw = torch.zeros(vocab, hidden, device=h.device)

        def run(cfg=cfg, gh=gh, gw=gw):
            launch_grad(h, w, None, y, tr, lse, sum_pz, -g_logp, g_logp, g_ent, None, gh, gw, None, True, cfg)

        run()
        grads[filt] = (gh.clone(), gw.clone())
        timed(f"flash backward kernel alone, peaked head, filter={filt}", run)
    set_filter(False)
    for i, name in enumerate(("d hidden", "d weight")):
        a, b = grads[True][i], grads[False][i]
        row(f"filter vs unfiltered, peaked head: {name}", f"{((a - b).norm() / b.norm()).item():.2e}",
            f"rel norm; max abs {(a - b).abs().max().item():.2e} of max {b.abs().max().item():.2e}")


def timings(h, w, y) -> None:
    from logitless.ops import flash_backend
    from logitless.ops.flash_kernels import flash_config, launch_grad
    from logitless.ops.plan import ChunkPlan
    from logitless.ops.transform import LogitTransform
    from logitless.ops.vocab_stats import token_logprobs

    n, hid = h.shape
    vocab = w.shape[0]
    tr = LogitTransform()
    row("flash config", str(flash_config()).replace("FlashConfig", ""))
    t1 = timed("GEMM logits h@W^T (bf16 out, cuBLAS)", lambda: torch.mm(h, w.t()))
    dy = torch.randn(n, vocab, device=h.device, dtype=torch.bfloat16) * 1e-3
    t2 = timed("GEMM d hidden dy@W (bf16 out)", lambda: torch.mm(dy, w))
    t3 = timed("GEMM d weight dy^T@h (bf16 out)", lambda: torch.mm(dy.t(), h))
    dy = None
    floor3 = (t1 + t2 + t3) if None not in (t1, t2, t3) else None
    if floor3 is not None:
        row("3-GEMM floor (sum)", f"{floor3:.3f} ms", "1.000x")

    plan = ChunkPlan(token_chunk=n, vocab_block=vocab, keep_logits=False)
    for ent in (False, True):
        timed(f"flash forward kernel+combine, one chunk of {n}, entropy={ent}",
              lambda ent=ent: flash_backend.chunk_forward(h, w, None, y, tr, plan, torch.float32, ent, False),
              t1, "of the logits GEMM")
    # The flash backend reuses the Triton plan, whose 1 GiB default budget cuts N into ~2k-token
    # chunks; a budget of N x V x 4 bytes gives it one chunk (it allocates nothing per logit).
    one_chunk = n * vocab * 4
    for impl, cb, label in (("flash", None, "default plan"), ("flash", one_chunk, "one chunk"),
                            ("triton", None, "default plan")):
        timed(f"rollout token_logprobs+entropy impl={impl} ({label})",
              lambda impl=impl, cb=cb: token_logprobs(h, w, y, return_entropy=True,
                                                      options=PassOptions(impl=impl, chunk_bytes=cb)),
              t1, "of the logits GEMM")

    part, _ = flash_backend.chunk_forward(h, w, None, y, tr, plan, torch.float32, True, False)
    lse, _, sum_pz = part.finalize()
    g_logp = -torch.ones(n, device=h.device)
    g_ent = torch.full((n,), 0.01, device=h.device)
    gh = torch.zeros(n, hid, device=h.device)
    gw = torch.zeros(vocab, hid, device=h.device)
    for filt in (False, True):
        set_filter(filt)
        cfg = flash_config()
        timed(f"flash backward kernel alone (one chunk), filter={filt}",
              lambda cfg=cfg: launch_grad(h, w, None, y, tr, lse, sum_pz, -g_logp, g_logp, g_ent, None, gh, gw,
                                          None, True, cfg), floor3, "of the 3-GEMM floor")
    set_filter(False)
    gh = gw = None

    for label, impl, filt, cb in (("flash", "flash", False, None), ("flash, one chunk", "flash", False, one_chunk),
                                  ("flash filter", "flash", True, None), ("triton", "triton", False, None)):
        set_filter(filt)
        timed(f"recompute fwd+bwd impl={label} (vocab_stats)", step_fn(h, w, y, impl, chunk_bytes=cb), floor3,
              "of the 3-GEMM floor")
    set_filter(False)


def memory(h, w, y) -> None:
    from logitless.ops.vocab_stats import token_logprobs

    if DEV["dry"]:
        row("peak memory", "skipped", "dry run")
        return
    for label, impl, filt in (("flash", "flash", False), ("flash filter", "flash", True),
                              ("triton", "triton", False)):
        set_filter(filt)

        def measure(label=label, impl=impl):
            step = step_fn(h, w, y, impl)
            _, hh, ww = step()  # warm (compilation, cuBLAS workspaces)
            hh.grad = ww.grad = None
            sync()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            sync()
            peak = torch.cuda.max_memory_allocated() - base
            row(f"peak memory fwd+bwd impl={label} beyond inputs", f"{peak / 2**20:.0f} MiB",
                "incl. fp32 d weight accumulator + bf16 grads")
            sync()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            token_logprobs(h, w, y, return_entropy=True, options=PassOptions(impl=impl))
            sync()
            row(f"peak memory rollout forward impl={label} beyond inputs",
                f"{(torch.cuda.max_memory_allocated() - base) / 2**20:.0f} MiB")

        guarded(f"peak memory impl={label}", measure)
    set_filter(False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--skip-check", action="store_true", help="timings and memory only")
    ap.add_argument("--dry-run", action="store_true", help="CPU + TRITON_INTERPRET=1 at tiny shapes")
    args = ap.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        DEV.update(device="cpu", dry=True)
        args.n, args.hidden, args.vocab = 64, 64, 301
    elif not torch.cuda.is_available():
        sys.exit("gpu_flash_check.py needs CUDA")
    import triton

    name = "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name()
    print(f"torch {torch.__version__} triton {triton.__version__} {name}; N={args.n} H={args.hidden} "
          f"V={args.vocab} bf16")
    h, w, y = make_inputs(args.n, args.hidden, args.vocab)
    if not args.skip_check:
        guarded("correctness", lambda: check_correctness(h, w, y))
        guarded("skippable tiles", lambda: skippable_tiles(h, w, y, min(args.n, 1024), 128))
    guarded("timings", lambda: timings(h, w, y))
    guarded("peaked filter", lambda: peaked_filter(args.n, args.hidden, args.vocab))
    guarded("memory", lambda: memory(h, w, y))
    print("\n| case | value | note |\n|---|---|---|")
    for case, value, note in ROWS:
        print(f"| {case} | {value} | {note} |")


if __name__ == "__main__":
    main()
