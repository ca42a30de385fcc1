"""Run a function in ``world`` gloo processes (CPU), or NCCL processes (one GPU each), and
collect each rank's result.

``fn(rank, world, arg)`` must be a module-level function (the spawned processes import its
module by name) whose result ``torch.save`` can write. Results cross back as bytes: a tensor
sent through the queue is a handle into the child's memory, gone once the child exits.
"""

from __future__ import annotations

import io
import os
import queue as queue_mod
import socket
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world: int, port: int, fn: Callable[[int, int, Any], Any], arg: Any, queue,
           backend: str = "gloo") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if backend == "nccl":  # rank r on GPU r, bound at init so collectives need no lazy device guess
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        buf = io.BytesIO()
        torch.save(fn(rank, world, arg), buf)
        queue.put((rank, buf.getvalue()))
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[[int, int, Any], Any], world: int, arg: Any, timeout_s: float = 240,
              backend: str = "gloo") -> list[Any]:
    """``[fn(0, world, arg), ..., fn(world - 1, world, arg)]``, each in its own process of one
    ``backend`` group ("gloo", or "nccl" with rank ``r`` on GPU ``r``). Fails as soon as a rank
    dies (its traceback is in the captured stderr), or after ``timeout_s`` (e.g. a rank left out
    of a collective); kills ranks left waiting."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, arg, queue, backend)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = {}
        deadline = time.monotonic() + timeout_s
        while len(results) < world:
            assert time.monotonic() < deadline, f"the ranks did not finish in {timeout_s:g} s"
            try:
                r, b = queue.get(timeout=1)
                results[r] = torch.load(io.BytesIO(b))
            except queue_mod.Empty:  # a rank that died sends nothing: fail now, not at the timeout
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                assert not dead, f"a rank exited with {dead[0]} (its traceback is in the captured stderr)"
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    finally:
        for p in procs:  # a rank left waiting on a dead peer's collective
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
