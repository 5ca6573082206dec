"""Compile every Triton kernel variant the captures need at once, in worker processes, before the
warm-up runs the phases one kernel at a time.

A cold capture is almost all Triton compiling, and the eager warm-up compiles the variants one
after another; threads do not help (most of a compile holds the GIL). So every phase of every
bucket is first recorded into a throw-away CUDA graph while triton's jit_cache_hook notes each
variant that would compile and skips it (no compile, no launch). Recording, not running, matters:
with the Triton kernels skipped, the torch kernels between them would read uninitialised indices;
a recorded graph never runs. Worker processes then compile the variants into Triton's disk cache
(JITFunction.preload) and build their launchers, and the warm-up that follows finds every one there.

The workers are forked from one process that imports torch, Triton and the kernels while this one
gets ready (Runtime.from_pretrained starts it before loading the checkpoint: start_early), rather
than each importing them at once. That process is started, not forked from this one, so it and its
workers have no CUDA state. A worker loads nothing onto the GPU: many CUDA contexts created at once
are slow, and this process loads every kernel into its own context anyway.

Best effort: any failure leaves the remaining kernels to the ordinary warm-up, which compiles
whatever is missing. Once it has run for a configuration, a marker in Triton's cache folder says
so, and later captures skip the recording pass, which would only add its own time to a warm start.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
import traceback
import warnings

import torch


def _marker(configuration: str) -> str:
    """The marker file for this configuration, this source tree and these library versions."""
    import graphrt.capture
    import graphrt.kernels
    import triton

    import graphrt

    h = hashlib.sha256(f"{configuration}|{triton.__version__}|{torch.__version__}".encode())
    for pkg in (graphrt, graphrt.kernels, graphrt.capture):
        for folder in pkg.__path__:
            for root, _, files in sorted(os.walk(folder)):
                for name in sorted(f for f in files if f.endswith(".py")):
                    with open(os.path.join(root, name), "rb") as f:
                        h.update(f.read())
    try:
        cache = triton.knobs.cache.dir
    except AttributeError:
        cache = os.environ.get("TRITON_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".triton", "cache"))
    return os.path.join(cache, "graphrt-precompiled", h.hexdigest())


@contextlib.contextmanager
def _recording_variants(variants: dict):
    """While active, a Triton launch that would compile records (module, name, specialisation) in
    variants and returns without compiling or launching."""
    from triton import knobs

    def hook(*, fn, compile, **_):
        variants[compile["specialization_data"]] = (fn.module, fn.name)
        return True  # skip the compile

    saved = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        yield
    finally:
        knobs.runtime.jit_cache_hook = saved


def stable_cache_keys(modules: list[str]) -> None:
    """Give every Triton function of the named modules the cache key a complete dependency walk
    gives. Triton folds a callee's global constants into its caller's key only if the callee's own
    key was computed before, so a kernel's key depends on what the process happened to launch
    first, and a variant compiled by one process is missed in the disk cache by the next.
    Recomputing every key until none changes removes that order; the compiled code is unchanged."""
    from triton.runtime.jit import JITFunction

    fns = []
    for name in sorted(modules):
        module = importlib.import_module(name)
        fns += [v for _, v in sorted(vars(module).items())
                if isinstance(v, JITFunction) and v.__module__ == name]
    keys = None
    for _ in range(8):
        if keys == (keys := [fn.cache_key for fn in fns]):
            return
        for fn in fns:
            fn.hash = None
    keys = [fn.cache_key for fn in fns]  # not settled in 8 rounds: leave none reset


def kernel_modules() -> list[str]:
    """The graphrt kernel modules this process has imported."""
    return sorted(name for name in sys.modules if name.startswith("graphrt.kernels."))


def _balanced(jobs: list[tuple[str, str, str]], n: int) -> list[list]:
    """Split jobs over n workers, longest first onto the least loaded, taking a kernel's source
    length as its compile time: the slowest worker decides when the pass ends."""
    costs = [len(inspect.getsource(getattr(importlib.import_module(job[0]), job[1]).fn)) for job in jobs]
    shares, loads = [[] for _ in range(n)], [0] * n
    for cost, job in sorted(zip(costs, jobs), key=lambda cj: cj[0], reverse=True):
        i = loads.index(min(loads))
        shares[i].append(job)
        loads[i] += cost
    return shares


def _default_workers() -> int:
    """The host's cores (32 at most), shared by the tensor-parallel ranks that capture at once."""
    ranks = 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", torch.distributed.get_world_size()))
    return max(1, min(os.cpu_count() or 1, 32) // ranks)


def _worker_gpu() -> str:
    """The GPU a worker sees (this process's CUDA_VISIBLE_DEVICES entry): a worker initialises CUDA,
    since Triton asks the device for its compile target, and every rank's workers would otherwise
    open contexts on device 0."""
    dev = torch.cuda.current_device()
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return visible[dev] if dev < len(visible) else str(dev)


_early: tuple | None = None  # (server, its stderr): started by start_early, not yet taken


def start_early() -> None:
    """Start the workers' parent now, so that its imports overlap what this process does before it
    captures (loading a checkpoint); the next precompile takes it, or stops it if Triton's cache
    already holds everything. At most one waits at a time."""
    global _early
    if _early is None:
        with contextlib.suppress(Exception):  # an optimisation only
            _early = _start_server()


def _start_server() -> tuple:
    log = tempfile.TemporaryFile()
    return subprocess.Popen([sys.executable, "-m", "graphrt.capture.precompile"], stdin=subprocess.PIPE,
                            stderr=log, text=True), log


def _take_server() -> tuple:
    """The server start_early started, else a new one."""
    global _early
    early, _early = _early, None
    return early or _start_server()


def _stop_early() -> None:
    global _early
    if _early is not None:
        _early[0].kill()
        _early[0].wait()
        _early[1].close()
        _early = None


def precompile(run_all, configuration: str, workers: int | None = None) -> int:
    """run_all(): launches every phase of every bucket, as the warm-up does. configuration: a
    description of everything that decides which kernel variants run (model configs, K, buckets,
    cache shapes, device). Returns how many kernel variants were compiled here (0 when skipped,
    unavailable or failed)."""
    modules = kernel_modules()
    stable_cache_keys(modules)
    marker = _marker(f"{configuration}|{torch.cuda.get_device_name()}")
    if os.path.exists(marker):
        _stop_early()  # nothing to compile
        return 0
    variants: dict[str, tuple[str, str]] = {}
    jobs, error, server, log = [], None, None, None
    try:
        # The workers' parent first (if start_early has not), so that its imports overlap the recording pass.
        server, log = _take_server()
        with _recording_variants(variants):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle(), capture_error_mode="relaxed"):
                run_all()
            del graph
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the throw-away graph's pool
        jobs = [(module, name, spec) for spec, (module, name) in variants.items()]
    except Exception as e:  # noqa: BLE001 - an optimisation only; the warm-up compiles the rest
        error, jobs = e, []
    try:
        shares = [share for share in _balanced(jobs, workers or _default_workers()) if share]
    except Exception as e:  # noqa: BLE001 - as above
        error, shares = error or e, []
    if server is not None and not shares and error is None:  # nothing to compile: no wait for its imports
        server.kill()
        server.wait()
        with contextlib.suppress(OSError):
            server.stdin.close()
        log.close()
    elif server is not None:
        with contextlib.suppress(OSError):
            server.stdin.write(json.dumps({"modules": modules, "shares": shares, "gpu": _worker_gpu()}))
            server.stdin.close()
        if server.wait() != 0 and error is None:
            log.seek(0)
            error = RuntimeError(log.read()[-2000:].decode(errors="replace"))
        log.close()
    if error is not None:
        warnings.warn(f"graphrt: parallel kernel precompile failed ({error}); the warm-up compiles serially",
                      stacklevel=2)
        return 0
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(marker), exist_ok=True)
        open(marker, "w").close()
    return len(jobs)


def _serve() -> None:
    """The workers' parent: read {"modules": [...], "shares": [[(module, name, specialisation)],
    ...], "gpu": its CUDA_VISIBLE_DEVICES} from stdin, then fork one worker a share, each compiling
    its variants into Triton's disk cache with their launchers (cached shared libraries) built too,
    none loaded onto the GPU. Exits 1 if any worker failed; nothing to read (its parent gone) is nothing to do."""
    import graphrt.kernels  # noqa: F401 - the slow imports, done while the parent gets ready
    from triton.runtime import driver

    text = sys.stdin.read()
    if not text:
        return
    work = json.loads(text)
    stable_cache_keys(work["modules"])  # once, for every worker
    pids = []
    for share in work["shares"]:
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            os.environ["CUDA_VISIBLE_DEVICES"] = work["gpu"]  # before this process initialises CUDA
            try:
                for module, name, spec in share:
                    kernel = getattr(importlib.import_module(module), name).preload(spec)
                    driver.active.launcher_cls(kernel.src, kernel.metadata)  # built and cached, nothing on the GPU
                code = 0
            except BaseException:  # noqa: BLE001 - reported to the parent, which warns
                traceback.print_exc()
            finally:
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    failed = [pid for pid in pids if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    _serve()
