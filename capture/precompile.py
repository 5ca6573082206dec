"""Compile every Triton kernel variant the captures need at once, on a thread pool, before the
warm-up runs the phases one kernel at a time.

A cold capture is almost all Triton compiling: each phase x bucket meets a few new specialisations,
and the eager warm-up compiles them one after another, each waiting on its ptxas and launcher
builds. Here every phase of every bucket is first recorded into a throw-away CUDA graph with each
Triton launch turned into a compile-only warm-up (triton's AsyncCompileMode hands the compile to
the pool and returns at once). Recording, not running, matters: with the Triton kernels skipped,
the torch kernels between them would read uninitialised indices; a recorded graph never runs.
When the pool has drained, the compiled modules are loaded on the device from the pool too.

Best effort: any failure leaves the remaining kernels to the ordinary warm-up, which compiles
whatever is missing, so capture never depends on this step. Once it has run for a configuration,
a marker in Triton's cache folder says so, and later captures (whose kernels Triton's disk cache
already holds) skip the recording pass, which would only add its own time to a warm start.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch


@contextlib.contextmanager
def _launches_compile_only():
    from triton.runtime.jit import JITFunction

    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    JITFunction.run = compile_only
    try:
        yield
    finally:
        JITFunction.run = run


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


def precompile(run_all, configuration: str, workers: int | None = None) -> int:
    """run_all(): launches every phase of every bucket, as the warm-up does. configuration: a
    description of everything that decides which kernel variants run (model configs, K, buckets,
    cache shapes, device). Returns how many kernel variants were compiled here (0 when skipped,
    unavailable or failed)."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:  # older triton: the warm-up compiles serially
        return 0
    marker = _marker(f"{configuration}|{torch.cuda.get_device_name()}")
    if os.path.exists(marker):
        return 0
    submitted = []

    class _Recording(AsyncCompileMode):
        def submit(self, key, *fns):
            fk = super().submit(key, *fns)
            submitted.append(fk)
            return fk

    workers = workers or min(32, os.cpu_count() or 1)
    device = torch.cuda.current_device()
    pool = torch.cuda.graph_pool_handle()
    recorded = False
    with ThreadPoolExecutor(workers) as ex:
        try:
            with _Recording(ex), _launches_compile_only():
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="relaxed"):
                    run_all()
                del graph
            recorded = True
        except Exception as e:  # noqa: BLE001 - an optimisation only; the warm-up compiles the rest
            warnings.warn(f"graphrt: parallel kernel precompile stopped early ({e}); "
                          "the warm-up compiles the remaining kernels", stacklevel=2)
        kernels = list({id(fk): fk.kernel for fk in submitted if fk.kernel is not None}.values())

        def load(kernel):
            torch.cuda.set_device(device)
            init = getattr(kernel, "_init_handles", None)
            if init is not None:
                init()

        try:
            list(ex.map(load, kernels))
        except Exception:  # noqa: BLE001 - loading on first launch instead
            pass
    torch.cuda.synchronize()
    if recorded:
        with contextlib.suppress(OSError):
            os.makedirs(os.path.dirname(marker), exist_ok=True)
            open(marker, "w").close()
    return len(kernels)
