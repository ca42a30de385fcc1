"""Two source trees compared through ``logitless bench`` (GPU only): each round runs the bench's
floor and logitless rows once per tree, each in its own process (``PYTHONPATH`` put in front of the
tree's ``src``), alternating trees, so the GPU's drift over the run falls on both alike; one line a
round, tree and case gives each objective's time over the floor of that run (from a
synchronization / in a step). For a kernel change with no switch: the old tree comes from
``git archive REV src | tar -x -C old``.

    ROUNDS=3 python3 scripts/gpu_src_ab.py old/src src [-- BENCH ARGS]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT_ARGS = ["--shapes", "8k:llama3-8b,8k:gemma2-2b", "--objectives", "grpo,ce,rollout,dpo",
                "--rows", "floor,logitless-fused,logitless", "--min-time", "0.5"]


def bench_lines(command: list[str], bench_args: list[str], env: dict[str, str] | None = None) -> list[str]:
    """One bench run (``command``, e.g. ``python -m logitless.cli bench``, in its own process): a
    line per case, each row's ratios to the floor."""
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([*command, *bench_args, "--out", out, "--no-report"], check=True, stdout=subprocess.DEVNULL,
                       env=env)
        (result,) = Path(out).rglob("*.json")
        data = json.loads(result.read_text())
    return [f"{case['model']} {case['n_tokens']}: " + " | ".join(
        f"{r['objective']} {r['row']} {r['ratio_to_floor']:.3f} / {r.get('in_step_ratio') or 0:.3f}"
        for r in case["results"] if r["row"] != "floor" and r.get("ratio_to_floor")) for case in data["cases"]]


def run_tree(src: str, bench_args: list[str]) -> list[str]:
    """:func:`bench_lines` of the bench on ``src`` (put in front of ``PYTHONPATH``)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(src).resolve()), os.environ.get("PYTHONPATH", "")]))
    return bench_lines([sys.executable, "-m", "logitless.cli", "bench"], bench_args, env)


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(what to compare, the bench's arguments)``: either side of a ``--``."""
    return (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])


def main() -> None:
    trees, bench_args = split_args(sys.argv[1:])
    for round_ in range(int(os.environ.get("ROUNDS", 2))):
        for src in trees:
            for line in run_tree(src, bench_args or DEFAULT_ARGS):
                print(f"round {round_} {src} {line}", flush=True)


if __name__ == "__main__":
    main()
