"""Arguments of the bench subcommand and the run itself.

Examples::

    logitless bench                          # GPU: N in {8k, 32k} x three model heads
    logitless bench --full                   # N in {4k, 8k, 32k, 128k} x three model heads
    logitless bench --quick                  # GPU: two small shapes; CPU: two tiny ones (seconds)
    logitless bench --shapes 8k:qwen2.5-7b,4096:2304x256000 --objectives grpo
    logitless bench --e2e                    # a whole GRPO training step, TRL vs logitless
    logitless bench --device cpu --quick --out /tmp/b   # CI
    logitless bench --report-only --update-repo          # regenerate the checkout's BENCHMARKS.md
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

from ..argtypes import csv_of, non_negative_float, non_negative_int, positive_float, positive_int, usage_error
from . import e2e, report
from .batches import GROUP_OBJECTIVES, is_group_objective
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
)
from .competitors import OBJECTIVES, ROW_NAMES, rows_of
from .runner import GRAD_TOL, LOSS_TOL, Options, run_case

PROG = "logitless bench"
DESCRIPTION = ("Benchmark logitless against the cuBLAS floor of the head and other libraries (default), or a "
               "whole GRPO training step of real architectures through TRL and through logitless (--e2e). "
               "Results go to a JSON file and a BENCHMARKS.md under --out. The numbers mean something on a CUDA "
               "GPU only: on a CPU (--device cpu, or no GPU) it runs tiny shapes whose times, ratios and memory are "
               "not representative; that run only checks that every row runs and agrees.")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_QUICK_GPU = ("4096:qwen2.5-7b", "8192:gemma2-2b")
_IMPLS = ("auto", "torch", "triton", "gemm", "flash")
DEFAULT_OUT = Path("bench_out")
CPU_NOTE = ("note: CPU run at tiny shapes: times, ratios and memory are not representative of a GPU; it checks "
            "that every row runs and agrees")
# e2e defaults: (models, completion lengths, batch sizes, prompt length, search cap in tokens)
_E2E_GPU = (e2e.GPU_MODELS, (1024, 4096), (1, 4, 8), 512, 1 << 17)
_E2E_GPU_QUICK = (("qwen2.5-1.5b",), (1024,), (1, 4), 512, 1 << 14)
_E2E_CPU = (("tiny-qwen2",), (16, 64), (1, 4), 8, 512)
_OP_ONLY = ("shapes", "tokens", "objectives", "rows", "impl", "entropy", "min_time")
_E2E_ONLY = ("completion_lengths", "batch_sizes", "prompt_length", "max_tokens", "zero_advantage_fractions")


def _fraction(text: str) -> float:
    x = non_negative_float(text)
    if x > 1.0:
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1], got {text!r}")
    return x


def _shape(text: str) -> Case:
    try:
        return parse_shape(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _objective(text: str) -> str:
    if text in OBJECTIVES or is_group_objective(text):
        return text
    raise argparse.ArgumentTypeError(f"unknown objective {text!r}: one of {', '.join(OBJECTIVES)}, or "
                                     f"grpo-c<percent>[-kl] (e.g. {', '.join(GROUP_OBJECTIVES)})")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the bench subcommand's options on ``parser`` and make :func:`run` its handler."""
    parser.description = DESCRIPTION
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="device (default: cuda when available, else cpu)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="two small shapes (tiny ones on CPU)")
    size.add_argument("--full", action="store_true",
                      help=f"N in {list(FULL_TOKENS)} x every model head (with --e2e: also llama3-8b)")
    size.add_argument("--shapes", type=csv_of(_shape), default=None,
                      help="comma list of N:model or N:HxV, e.g. 8k:qwen2.5-7b,4096:2304x256000")
    parser.add_argument("--models", type=csv_of(), default=None,
                        help=f"model heads of the grid (default all): {', '.join(MODELS)}; with --e2e the "
                             f"architectures: {', '.join(e2e.ARCHS)}")
    parser.add_argument("--tokens", type=csv_of(positive_int), default=None,
                        help=f"token counts of the grid (default {','.join(map(str, DEFAULT_TOKENS))}; 8k = 8192)")
    parser.add_argument("--objectives", type=csv_of(_objective), default=None,
                        help=f"objectives to run (default {','.join(OBJECTIVES)}); GRPO batches with group-reward "
                             f"advantages, c<percent> of the groups reward-constant, beta 0 (-kl: 0.04): "
                             f"{','.join(GROUP_OBJECTIVES)}")
    parser.add_argument("--rows", type=csv_of(choices=ROW_NAMES), default=None,
                        help=f"rows to run (the floor always runs; without --objectives, the objectives that have one "
                             f"of them): {', '.join(ROW_NAMES)}")
    parser.add_argument("--impl", type=csv_of(choices=_IMPLS), default=None,
                        help="logitless backend(s): auto (default), torch, triton; several give one row set each")
    parser.add_argument("--dtype", choices=tuple(_DTYPES), default=None,
                        help="input / model dtype (default bfloat16; float32 for --e2e on CPU)")
    parser.add_argument("--entropy", type=positive_float, default=None,
                        help="target mean entropy of the inputs, nats (default 2.0)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the inputs and weights (default 0)")
    parser.add_argument("--min-time", type=non_negative_float, default=None,
                        help="seconds of timed calls per row (default 1.0; 0.2 with --quick)")
    parser.add_argument("--reps", type=positive_int, default=None,
                        help="at least this many timed calls per row (default 3; 2 on CPU with --quick or --e2e)")
    parser.add_argument("--time-budget", type=positive_float, default=None,
                        help="seconds after which no new row or step starts (the rest are recorded as skipped)")
    e = parser.add_argument_group("end-to-end GRPO step (--e2e)")
    e.add_argument("--e2e", action="store_true",
                   help="time one GRPO training step (forward, loss, backward, SGD step) of real architectures "
                        "with random weights, through trl.GRPOTrainer and through LogitlessGRPOTrainer; then the "
                        "largest micro-batch each fits")
    e.add_argument("--completion-lengths", type=csv_of(positive_int), default=None,
                   help="completion lengths of the grid (default 1024,4096 on GPU, 16,64 on CPU)")
    e.add_argument("--batch-sizes", type=csv_of(positive_int), default=None,
                   help="sequences per micro-batch of the grid (default 1,4,8; CPU 1,4)")
    e.add_argument("--prompt-length", type=positive_int, default=None, help="prompt tokens (default 512; CPU 8)")
    e.add_argument("--max-tokens", type=non_negative_int, default=None,
                   help="cap of the largest-micro-batch search, tokens (default 131072; CPU 512; 0 skips it)")
    e.add_argument("--zero-advantage-fractions", type=csv_of(_fraction), default=None,
                   help="fractions of each batch's completions with advantage 0 (reward-constant groups) for the "
                        "logitless-skip rows (LogitlessConfig(skip_zero_advantage=True)), e.g. the demo's measured "
                        "frac_reward_zero_std,0.25,0.5 (default 0.25,0.5)")
    out = parser.add_argument_group("output")
    where = out.add_mutually_exclusive_group()
    where.add_argument("--out", "--out-dir", dest="out_dir", type=Path, default=None, metavar="DIR",
                       help=f"folder of BENCHMARKS.md and benchmarks/ (results, plot) (default: ./{DEFAULT_OUT})")
    where.add_argument("--update-repo", action="store_true",
                       help="write into this source checkout: its benchmarks/results/ and BENCHMARKS.md")
    out.add_argument("--results-dir", type=Path, default=None, help="JSON folder (default OUT/benchmarks/results)")
    out.add_argument("--no-report", action="store_true", help="write the JSON only")
    out.add_argument("--report-only", action="store_true",
                     help="only regenerate BENCHMARKS.md and the plot from the JSON files")
    parser.set_defaults(func=run)


def _cases(args: argparse.Namespace, device: torch.device) -> list[Case]:
    if args.shapes:
        return list(args.shapes)
    if device.type == "cpu":
        if args.quick:
            return [parse_shape(s) for s in QUICK_CPU]
        return grid(args.models or list(CPU_MODELS), args.tokens or list(CPU_TOKENS))
    if args.quick:
        return [parse_shape(s) for s in _QUICK_GPU]
    return grid(args.models or list(MODELS), args.tokens or list(FULL_TOKENS if args.full else DEFAULT_TOKENS))


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


def repo_root() -> Path | None:
    """The source checkout this package runs from (``pip install -e .``), or ``None``."""
    root = Path(__file__).resolve().parents[3]
    return root if (root / "pyproject.toml").is_file() and (root / "src" / "logitless").is_dir() else None


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check(args: argparse.Namespace) -> torch.device:
    """Usage errors no single option's type can see (exit 2, one line); returns the device."""
    if args.update_repo:
        root = repo_root()
        if root is None:
            usage_error(PROG, "--update-repo needs a source checkout of logitless (pip install -e .); "
                              "pass --out DIR instead")
        args.out_dir = root
    else:
        args.out_dir = args.out_dir or DEFAULT_OUT
        root = repo_root()
        if root is not None and args.out_dir.resolve() == root:
            usage_error(PROG, f"--out {args.out_dir} is this checkout: its BENCHMARKS.md would be rewritten; "
                              "pass --update-repo to do that on purpose")
    results_dir = args.results_dir or args.out_dir / report.RESULTS_DIR
    for flag, path in (("--out", args.out_dir), ("--results-dir", results_dir)):
        if path.exists() and not path.is_dir():
            usage_error(PROG, f"{flag} {path}: exists and is not a directory")
    if args.report_only:
        if not results_dir.is_dir():
            usage_error(PROG, f"--report-only: no results folder {results_dir}; run logitless bench first, or pass "
                              "--out / --results-dir")
        return torch.device("cpu")
    given = lambda names: [_flag(n) for n in names if getattr(args, n) is not None]  # noqa: E731
    if args.e2e and given(_OP_ONLY):
        usage_error(PROG, f"{', '.join(given(_OP_ONLY))} only apply to the head benchmark, not to --e2e")
    if not args.e2e and given(_E2E_ONLY):
        usage_error(PROG, f"{', '.join(given(_E2E_ONLY))} only apply with --e2e")
    for objective in (args.objectives or []) if args.rows else []:
        # An objective none of whose rows is asked for would time its floor alone.
        if not _has_row(objective, args.rows):
            names = [r.name for r in rows_of(objective) if r.role != "floor"]
            usage_error(PROG, f"--rows {','.join(args.rows)} names no row of --objectives {objective}; its rows: "
                              f"{', '.join(names)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        usage_error(PROG, "--device cuda, but no CUDA GPU is visible to PyTorch; use --device cpu")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    known = e2e.ARCHS if args.e2e else {**MODELS, **CPU_MODELS}
    bad = [m for m in args.models or [] if m not in known]
    if bad:
        usage_error(PROG, f"unknown model {', '.join(map(repr, bad))} for --models; choose from {', '.join(known)}")
    if not args.e2e and not args.shapes and args.models and args.tokens:
        try:  # every pair must be a valid shape
            grid(args.models, args.tokens)
        except ValueError as e:
            usage_error(PROG, str(e))
    return device


def _has_row(objective: str, rows: list[str] | None) -> bool:
    """Whether ``--rows`` (``None``: all) names a row of ``objective`` other than its floor."""
    return rows is None or any(r.name in rows for r in rows_of(objective) if r.role != "floor")


def _run_record(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    argv = getattr(args, "argv", None)
    if argv is None:
        argv = sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]
    return {
        "schema": 1,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join([PROG, *argv]),
        "device": _device_info(device),
        "versions": _versions(),
    }


def run(args: argparse.Namespace) -> int:
    """Run the benchmark (or only the report); returns the exit status: 1 when a logitless row
    or step failed with an error, else 0."""
    device = _check(args)
    out_dir: Path = args.out_dir
    results_dir = args.results_dir or out_dir / report.RESULTS_DIR
    if args.report_only:
        md, png = report.regenerate(out_dir, results_dir)
        print(f"wrote {md}" + (f" and {png}" if png else ""))
        return 0
    if device.type == "cpu":
        print(CPU_NOTE, file=sys.stderr)
    run_record, failed = (_run_e2e if args.e2e else _run_heads)(args, device)
    path = report.write_json(run_record, results_dir)
    print()
    print(report.console_table(run_record))
    print(f"\nwrote {path}")
    if not args.no_report:
        md, png = report.regenerate(out_dir, results_dir)
        print(f"wrote {md}" + (f" and {png}" if png else ""))
    return 1 if failed else 0


def _log(msg: str) -> None:
    print(msg, flush=True)


def _run_heads(args: argparse.Namespace, device: torch.device) -> tuple[dict[str, Any], bool]:
    cases = _cases(args, device)
    quick_cpu = args.quick and device.type == "cpu"
    if quick_cpu:
        # Seconds, not minutes, on a shared CI machine: tiny matmuls under a contended thread pool
        # run ~20x slower than on one thread.
        torch.set_num_threads(1)
    start = time.monotonic()
    objectives = args.objectives or [o for o in OBJECTIVES if _has_row(o, args.rows)]
    impls = args.impl or ["auto"]
    opts = Options(device=device, dtype=_DTYPES[args.dtype or "bfloat16"], impls=impls, objectives=objectives,
                   rows=args.rows, target_entropy=2.0 if args.entropy is None else args.entropy, seed=args.seed,
                   min_time_s=args.min_time if args.min_time is not None else (0.2 if args.quick else 1.0),
                   min_reps=args.reps or (2 if quick_cpu else 3), max_reps=max(args.reps or 0, 5 if quick_cpu else 20),
                   deadline=None if args.time_budget is None else start + args.time_budget)
    record = {**_run_record(args, device), "objectives": objectives, "impls": impls,
              "tolerances": {"loss": LOSS_TOL, "grad": GRAD_TOL}, "cases": []}
    for case in cases:
        record["cases"].append(run_case(case, opts, _log))
    record["wall_s"] = time.monotonic() - start
    failed = any(r["row"].startswith("logitless") and r["status"] == "error"
                 for c in record["cases"] for r in c["results"])
    return record, failed


def _run_e2e(args: argparse.Namespace, device: torch.device) -> tuple[dict[str, Any], bool]:
    if device.type == "cpu":
        models, lengths, batches, prompt, cap = _E2E_CPU
    else:
        models, lengths, batches, prompt, cap = _E2E_GPU_QUICK if args.quick else _E2E_GPU
        if args.full:
            models = e2e.FULL_GPU_MODELS
    dtype = args.dtype or ("float32" if device.type == "cpu" else "bfloat16")
    start = time.monotonic()
    opts = e2e.E2EOptions(
        device=device, dtype=_DTYPES[dtype], models=tuple(args.models or models),
        completion_lengths=tuple(args.completion_lengths or lengths), batch_sizes=tuple(args.batch_sizes or batches),
        prompt_length=args.prompt_length or prompt, max_tokens=cap if args.max_tokens is None else args.max_tokens,
        reps=args.reps or (2 if device.type == "cpu" else 3), seed=args.seed,
        deadline=None if args.time_budget is None else start + args.time_budget,
        zero_advantage_fractions=tuple(args.zero_advantage_fractions or (0.25, 0.5)))
    record = {**_run_record(args, device), "kind": "e2e",
              "settings": {"dtype": dtype, "prompt_length": opts.prompt_length, "reps": opts.reps,
                           "max_tokens": opts.max_tokens, "optimizer": f"SGD(lr={e2e.LR:g}, momentum=0)",
                           "grpo_config": "TRL defaults (loss_type=dapo, beta=0, gradient_checkpointing=True)"},
              "models": []}
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny matmuls under a contended thread pool run many times slower
    try:
        record["models"] = e2e.run(opts, _log)
    finally:
        torch.set_num_threads(threads)
    record["wall_s"] = time.monotonic() - start
    failed = any(s["path"].startswith("logitless") and s["status"] == "error"
                 for m in record["models"] for s in (*m["steps"], *m.get("skip_steps", ())))
    return record, failed
