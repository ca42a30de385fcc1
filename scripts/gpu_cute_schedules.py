"""The CuTe DSL statistics GEMM's two schedules compared through ``logitless bench`` (GPU only,
sm90, with the CuTe DSL importable): each ``STORE:STATS`` pair (the schedule, ``cooperative`` or
``pingpong``, of the kernel that stores the tile and of the one that does not) runs the bench's
floor and logitless rows in its own process, and one line per pair gives each objective's time
over the floor of that run (from a synchronization / in a step).

    python3 scripts/gpu_cute_schedules.py cooperative:cooperative pingpong:cooperative [-- BENCH ARGS]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

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
    argv = sys.argv[1:]
    pairs, bench_args = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    for pair in pairs:
        with tempfile.TemporaryDirectory() as out:
            subprocess.run([sys.executable, "-c", CHILD, pair, "bench", *(bench_args or DEFAULT_ARGS), "--out", out,
                            "--no-report"], check=True, stdout=subprocess.DEVNULL)
            (result,) = Path(out).rglob("*.json")
            data = json.loads(result.read_text())
        for case in data["cases"]:
            cells = [f"{r['objective']} {r['row']} {r['ratio_to_floor']:.3f} / {r.get('in_step_ratio') or 0:.3f}"
                     for r in case["results"] if r["row"] != "floor" and r.get("ratio_to_floor")]
            print(f"{pair} {case['model']} {case['n_tokens']}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
