"""The logitless command line: demo, bench, refcache, env.

Only the chosen subcommand's module is imported (each pulls in torch, which takes seconds), so
``logitless --help`` and a bare ``logitless`` answer at once.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

from . import __version__
from .integrations import TESTED_TRL

# name -> (module whose add_arguments(parser) registers the options, one-line help)
_COMMANDS = {
    "demo": ("logitless.demo", "GRPO-train SmolLM2-135M-Instruct on addition with TRL through logitless "
                               "(--quick: a few minutes on a CPU)"),
    "bench": ("logitless.bench.cli", "benchmark against the cuBLAS floor, TRL and other libraries (GPU; a CPU "
                                     "run only checks that everything runs)"),
    "refcache": ("logitless.refcache.cli", "build / inspect / verify a reference log-prob cache"),
    "env": ("logitless.cli", "versions, device and the backend impl='auto' picks here (paste it into bug reports)"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``logitless`` parser; the options of every subcommand, or only of ``only`` (a name of
    :data:`_COMMANDS`, or ``""`` for none: top-level help needs none of them)."""
    parser = argparse.ArgumentParser(
        prog="logitless",
        description="LLM output-head losses and metrics without materializing logits: a demo, benchmarks, the "
                    "reference log-prob cache, and the environment report.")
    parser.add_argument("--version", action="version", version=f"logitless {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(_COMMANDS) + "}")
    for name, (module, help_text) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if only is None or only == name:
            importlib.import_module(module).add_arguments(p)
    return parser


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``env`` subcommand (no options)."""
    p.description = ("Print the versions logitless runs with (python, torch, triton, transformers, trl, logitless), "
                     f"the CUDA device, the backend PassOptions(impl='auto') resolves to here, and whether TRL is the "
                     f"tested {TESTED_TRL}.* release.")
    p.set_defaults(func=env)


def _command(argv: list[str]) -> str:
    """The subcommand named in ``argv`` ("" when none: top-level options only, or an unknown word
    that argparse will refuse)."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in _COMMANDS else ""
    return ""


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``logitless`` command; returns the exit status (2: a usage error)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(only=_command(argv))
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    args.argv = argv[1:]  # the subcommand's own arguments, recorded by bench
    return int(args.func(args) or 0)


def _version(dist: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def env_report() -> dict[str, Any]:
    """What :func:`env` prints, as a dict: package versions (``None``: not installed), the CUDA
    device, the backend ``impl="auto"`` picks for bf16 and fp32 inputs on it, and whether the
    installed TRL is the release the integrations are tested with."""
    import platform

    import torch

    from .ops.contract import resolve_backend

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("triton", "transformers", "trl", "accelerate", "peft"):
        versions[dist] = _version(dist)
    versions["logitless"] = __version__
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    report: dict[str, Any] = {
        "versions": versions,
        "cuda": {"device": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0)),
                 "torch_cuda": torch.version.cuda} if cuda else None,
        "auto_backend": {str(dtype).removeprefix("torch."): resolve_backend("auto", torch.empty(1, 1, dtype=dtype,
                                                                                                   device=device)).NAME
                         for dtype in (torch.bfloat16, torch.float32)},
        "auto_device": device.type,
    }
    trl = versions["trl"]
    report["trl_tested"] = trl is not None and (trl == TESTED_TRL or trl.startswith(TESTED_TRL + "."))
    return report


def env(_args: argparse.Namespace) -> int:
    """Print :func:`env_report` as aligned text."""
    r = env_report()
    for name, v in r["versions"].items():
        note = ""
        if name == "trl" and v is not None:
            note = "  (the tested release)" if r["trl_tested"] else f"  (not the tested {TESTED_TRL}.*: the drop-ins " \
                                                                    "may not match TRL's own path)"
        print(f"{name:<14}{v or 'not installed'}{note}")
    c = r["cuda"]
    print(f"{'cuda':<14}" + (f"{c['device']} (sm_{c['capability'][0]}{c['capability'][1]}, CUDA {c['torch_cuda']})"
                            if c else "no CUDA device"))
    backends = ", ".join(f"{dtype} -> {name}" for dtype, name in r["auto_backend"].items())
    print(f"{'impl=auto':<14}{backends} (inputs on {r['auto_device']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
