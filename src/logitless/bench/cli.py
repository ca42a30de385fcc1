"""Arguments of ``logitless bench`` and the run itself.

Examples::

    logitless bench                          # GPU: N in {8k, 32k} x three model heads
    logitless bench --full                   # N in {4k, 8k, 32k, 128k} x three model heads
    logitless bench --quick                  # GPU: two small shapes; CPU: two tiny ones (seconds)
    logitless bench --shapes 8k:qwen2.5-7b,4096:2304x256000 --objectives grpo
    logitless bench --device cpu --quick --out-dir /tmp/b   # CI
    logitless bench --report-only            # regenerate BENCHMARKS.md + plot from the JSON files
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from . import report
from .cases import (
    CPU_MODELS,
    CPU_TOKENS,
    DEFAULT_TOKENS,
    FULL_TOKENS,
    MODELS,
    QUICK_CPU,
    Case,
    grid,
    parse_shape,
    parse_tokens,
)
from .competitors import OBJECTIVES, ROW_NAMES
from .runner import GRAD_TOL, LOSS_TOL, Options, run_case

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_QUICK_GPU = ("4096:qwen2.5-7b", "8192:gemma2-2b")


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``logitless bench``'s options on ``parser`` and make :func:`run` its handler."""
    parser.description = __doc__.split("\n\n")[0] if __doc__ else None
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="device (default: cuda when available, else cpu)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="two small shapes (tiny ones on CPU)")
    size.add_argument("--full", action="store_true", help=f"N in {list(FULL_TOKENS)} x every model head")
    size.add_argument("--shapes", type=_csv, default=None,
                      help="comma list of N:model or N:HxV, e.g. 8k:qwen2.5-7b,4096:2304x256000")
    parser.add_argument("--models", type=_csv, default=None,
                        help=f"model heads of the grid (default all): {', '.join(MODELS)}")
    parser.add_argument("--tokens", type=_csv, default=None,
                        help=f"token counts of the grid (default {','.join(map(str, DEFAULT_TOKENS))})")
    parser.add_argument("--objectives", type=_csv, default=list(OBJECTIVES), help="grpo,ce,rollout (default all)")
    parser.add_argument("--rows", type=_csv, default=None,
                        help=f"rows to run (the floor always runs): {', '.join(ROW_NAMES)}")
    parser.add_argument("--impl", type=_csv, default=["auto"],
                        help="logitless backend(s): auto, torch, triton; several give one row set each")
    parser.add_argument("--dtype", choices=tuple(_DTYPES), default="bfloat16")
    parser.add_argument("--entropy", type=float, default=2.0, help="target mean entropy of the inputs (nats)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-time", type=float, default=None,
                        help="seconds of timed calls per row (default 1.0; 0.2 with --quick)")
    parser.add_argument("--reps", type=int, default=None, help="at least this many timed calls per row (default 3)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds after which no new row starts (the rest are recorded as skipped)")
    parser.add_argument("--out-dir", type=Path, default=Path("."),
                        help="where BENCHMARKS.md and benchmarks/ (results, plot) are written (default: .)")
    parser.add_argument("--results-dir", type=Path, default=None,
                        help="JSON folder (default OUT_DIR/benchmarks/results)")
    parser.add_argument("--no-report", action="store_true", help="write the JSON only")
    parser.add_argument("--report-only", action="store_true",
                        help="only regenerate BENCHMARKS.md and the plot from the JSON files")
    parser.set_defaults(func=run)


def _cases(args: argparse.Namespace, device: torch.device) -> list[Case]:
    if args.shapes:
        return [parse_shape(s) for s in args.shapes]
    if device.type == "cpu":
        if args.quick:
            return [parse_shape(s) for s in QUICK_CPU]
        if not (args.quick or args.models or args.tokens):
            print("note: no GPU; running the tiny CPU shapes (pass --shapes for others)", file=sys.stderr)
        return grid(args.models or list(CPU_MODELS), [parse_tokens(t) for t in args.tokens or []] or list(CPU_TOKENS))
    if args.quick:
        return [parse_shape(s) for s in _QUICK_GPU]
    tokens = [parse_tokens(t) for t in args.tokens] if args.tokens else list(FULL_TOKENS if args.full
                                                                             else DEFAULT_TOKENS)
    return grid(args.models or list(MODELS), tokens)


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("logitless", "triton", "trl", "transformers", "liger-kernel", "cut-cross-entropy"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    if out["logitless"] is None:
        import logitless

        out["logitless"] = logitless.__version__
    return out


def _device_info(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"type": "cuda", "name": props.name, "total_memory": props.total_memory,
                "multiprocessors": props.multi_processor_count, "cuda": torch.version.cuda}
    return {"type": "cpu", "name": f"cpu-{platform.machine()}", "threads": torch.get_num_threads()}


def _validate(args: argparse.Namespace) -> None:
    for o in args.objectives:
        if o not in OBJECTIVES:
            raise SystemExit(f"logitless bench: unknown objective {o!r}; choose from {', '.join(OBJECTIVES)}")
    for r in args.rows or []:
        if r not in ROW_NAMES:
            raise SystemExit(f"logitless bench: unknown row {r!r}; choose from {', '.join(ROW_NAMES)}")
    if args.reps is not None and args.reps < 1:
        raise SystemExit(f"logitless bench: --reps must be >= 1, got {args.reps}")
    for i in args.impl:
        if i not in ("auto", "torch", "triton"):
            raise SystemExit(f"logitless bench: unknown impl {i!r}; choose from auto, torch, triton")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark (or only the report); returns the exit status: 1 when a logitless row
    failed with an error, else 0."""
    out_dir: Path = args.out_dir
    results_dir = args.results_dir or out_dir / report.RESULTS_DIR
    if args.report_only:
        md, png = report.regenerate(out_dir, results_dir)
        print(f"wrote {md}" + (f" and {png}" if png else ""))
        return 0
    _validate(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("logitless bench: --device cuda but CUDA is not available")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        cases = _cases(args, device)
    except ValueError as e:
        raise SystemExit(f"logitless bench: {e}") from None
    quick_cpu = args.quick and device.type == "cpu"
    if quick_cpu:
        # Seconds, not minutes, on a shared CI machine: tiny matmuls under a contended thread pool
        # run ~20x slower than on one thread.
        torch.set_num_threads(1)
    start = time.monotonic()
    opts = Options(device=device, dtype=_DTYPES[args.dtype], impls=args.impl, objectives=args.objectives,
                   rows=args.rows, target_entropy=args.entropy, seed=args.seed,
                   min_time_s=args.min_time if args.min_time is not None else (0.2 if args.quick else 1.0),
                   min_reps=args.reps or (2 if quick_cpu else 3), max_reps=max(args.reps or 0, 5 if quick_cpu else 20),
                   deadline=None if args.time_budget is None else start + args.time_budget)
    run_record: dict[str, Any] = {
        "schema": 1,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": "logitless bench " + " ".join(sys.argv[1:] if sys.argv[1:2] != ["bench"] else sys.argv[2:]),
        "device": _device_info(device),
        "versions": _versions(),
        "objectives": args.objectives,
        "impls": args.impl,
        "tolerances": {"loss": LOSS_TOL, "grad": GRAD_TOL},
        "cases": [],
    }

    def log(msg: str) -> None:
        print(msg, flush=True)

    for case in cases:
        run_record["cases"].append(run_case(case, opts, log))
    run_record["wall_s"] = time.monotonic() - start
    path = report.write_json(run_record, results_dir)
    print()
    print(report.console_table(run_record))
    print(f"\nwrote {path}")
    if not args.no_report:
        md, png = report.regenerate(out_dir, results_dir)
        print(f"wrote {md}" + (f" and {png}" if png else ""))
    failed = [r for c in run_record["cases"] for r in c["results"]
              if r["row"].startswith("logitless") and r["status"] == "error"]
    return 1 if failed else 0
