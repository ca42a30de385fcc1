"""The CuTe DSL statistics GEMM's two schedules compared through ``logitless bench`` (GPU only,
sm90, with the CuTe DSL importable): each ``STORE:STATS`` pair (the schedule, ``cooperative`` or
``pingpong``, of the kernel that stores the tile and of the one that does not) runs the bench's
floor and logitless rows in its own process, and one line per pair gives each objective's time
over the floor of that run (from a synchronization / in a step).

    python3 scripts/gpu_cute_schedules.py cooperative:cooperative pingpong:cooperative [-- BENCH ARGS]
"""

from __future__ import annotations

import sys

from gpu_src_ab import bench_lines, split_args  # (this script's folder is on sys.path)

CHILD = """
import sys
from logitless.ops.cute_backend import kernels
kernels.PINGPONG_STORING, kernels.PINGPONG_STATS = (s == "pingpong" for s in sys.argv[1].split(":"))
from logitless.cli import main
sys.exit(main(sys.argv[2:]))
"""
DEFAULT_ARGS = ["--shapes", "8k:llama3-8b,8k:gemma2-2b", "--objectives", "grpo,ce,rollout,dpo",
                "--rows", "floor,logitless-fused,logitless", "--min-time", "0.5"]


def main() -> None:
    pairs, bench_args = split_args(sys.argv[1:])
    for pair in pairs:
        for line in bench_lines([sys.executable, "-c", CHILD, pair, "bench"], bench_args or DEFAULT_ARGS):
            print(f"{pair} {line}", flush=True)


if __name__ == "__main__":
    main()
