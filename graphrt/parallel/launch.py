"""`graphrt ... --tp N` without torchrun: start N processes as the ranks of one group (the
environment torchrun would give them), and stop them all when one fails, so that no rank waits
forever in a collective that a dead rank will never join."""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import signal
import socket
import sys
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, fn, args, quiet: bool) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if quiet and rank:  # rank 0 reports; the others' output would repeat it
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (lives as long as the process)
    # a hung rank prints where every thread waits when the launcher gives up on it (stderr)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    code = fn(*args)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # Not sys.exit: gloo's worker threads can still hold tensors at interpreter teardown, which then
    # aborts the process ("terminate called without an active exception", SIGABRT) now and then.
    os._exit(code or 0)


def run_ranks(world_size: int, fn, *args, quiet: bool = True, timeout_s: float | None = None,
              start_method: str = "spawn") -> int:
    """Run fn(*args) in world_size fresh processes, rank r on cuda:r when CUDA is there. Returns
    the first non-zero exit code (0 when all succeed); a rank's failure or the timeout ends the
    rest. fn must be importable (a module-level function). start_method "fork" (CPU only: CUDA
    needs "spawn") saves each rank its imports."""
    ctx = mp.get_context(start_method)
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, fn, args, quiet)) for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    code = 0
    while any(p.is_alive() for p in procs):
        failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
        if failed or (deadline is not None and time.monotonic() > deadline):
            code = failed[0] if failed else 124
            break
        time.sleep(0.05)
    if code == 124:
        dump_stacks(procs)
    # a failed rank's peers get a moment to raise the same error themselves (TensorParallel.agree)
    # (after a timeout every rank is stuck: nothing to wait for)
    for p in procs:
        p.join(timeout=None if not code else 0 if code == 124 else 10)
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join()
    return code or next((p.exitcode for p in procs if p.exitcode), 0)


def dump_stacks(procs, wait_s: float = 2.0) -> None:
    """Ask every live rank for its Python stacks (faulthandler on SIGUSR1, set up in each rank
    before it runs anything), so that a timeout says which collective or compile it was stuck in."""
    for p in procs:  # one at a time, so that the dumps do not interleave
        if p.is_alive() and p.pid is not None:
            os.kill(p.pid, signal.SIGUSR1)
            time.sleep(wait_s / len(procs))

