"""`graphrt ... --tp N` without torchrun: start N processes as the ranks of one group (the
environment torchrun would give them), and stop them all when one fails, so that no rank waits
forever in a collective that a dead rank will never join."""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import socket
import sys
import time


def _rank_main(rank: int, world_size: int, port: int, fn, args, quiet: bool, deadline: float | None) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if quiet and rank:  # rank 0 reports; the others' output would repeat it
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (lives as long as the process)
    if deadline is not None:
        # Every thread's stack to stderr just before the deadline (what a stopped rank waited in), from a
        # watchdog thread: no signal handler runs while a rank blocks in NCCL or CUDA. The ranks a
        # moment apart, so that their dumps do not interleave.
        margin_s = 3.0 - 2.0 * rank / world_size
        faulthandler.dump_traceback_later(max(1.0, deadline - time.time() - margin_s), exit=False)
    _exit_rank(fn(*args) or 0)


def _exit_rank(code: int = 0):
    """End this rank's process now. An NCCL group is not destroyed: with CUDA graphs that captured
    its collectives still alive, destroy_process_group has been seen never to return, and the
    process's exit releases the communicator anyway. Not sys.exit: gloo's worker
    threads can still hold tensors at interpreter teardown, which then aborts the process
    ("terminate called without an active exception", SIGABRT) now and then."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() != "nccl":
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_ranks(world_size: int, fn, *args, quiet: bool = True, timeout_s: float | None = None,
              start_method: str = "spawn") -> int:
    """Run fn(*args) in world_size fresh processes, rank r on cuda:r when CUDA is there. Returns
    the first non-zero exit code (0 when all succeed); a rank's failure or the timeout ends the
    rest. fn must be importable (a module-level function). start_method "fork" (CPU only: CUDA
    needs "spawn") saves each rank its imports."""
    ctx = mp.get_context(start_method)
    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # wall clock: the ranks are other processes, and each dumps its stacks just before it
    deadline = None if timeout_s is None else time.time() + timeout_s
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, fn, args, quiet, deadline))
             for r in range(world_size)]
    for p in procs:
        p.start()
    code = 0
    while any(p.is_alive() for p in procs):
        failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
        if failed or (deadline is not None and time.time() > deadline):
            code = failed[0] if failed else 124
            break
        time.sleep(0.05)
    # a failed rank's peers get a moment to raise the same error themselves (TensorParallel.agree)
    # (after a timeout every rank is stuck: nothing to wait for)
    for p in procs:
        p.join(timeout=None if not code else 0 if code == 124 else 10)
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join()
    return code or next((p.exitcode for p in procs if p.exitcode), 0)
