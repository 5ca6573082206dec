import os

import torch

# Without a GPU the Triton kernels still run, under Triton's interpreter; the switch must be set
# before any @triton.jit decorator executes, hence here, before graphrt is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Each of pytest-xdist's workers has a core of its own: a second OpenMP thread would only
    # spin against the other worker (on 2 cores the suite took 390 s with two threads a worker, 247 s with one).
    torch.set_num_threads(1)


def _look_up_interpreter_builtins_once():
    """Triton's interpreter finds the builtins of triton.language with inspect.getmembers at every
    call of a jit function, nested helpers included: about a third of this suite's time on the CPU.
    The set of builtins never changes, so each package's is looked up once and the same wrappers are
    installed as before. A Triton whose interpreter lacks these internals keeps its own lookup."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    needed = (getattr(interpreter, "_patch_builtin", None), getattr(interpreter, "_patch_attr", None),
              getattr(tl.core, "is_builtin", None))
    if not all(map(callable, needed)) or [list(inspect.signature(f).parameters) for f in needed[:2]] != [
            ["pkg", "builder", "scope"], ["obj", "name", "member", "builder", "scope"]]:
        return
    found: dict[object, list] = {}

    def patch_builtin(pkg, builder, scope):
        members = found.get(pkg)
        if members is None:  # first seen from a top-level launch: nothing patched yet
            members = found[pkg] = [(n, m) for n, m in inspect.getmembers(pkg) if tl.core.is_builtin(m)]
        # Inside a nested call the outer call's wrappers are in place, which Triton's own lookup
        # does not take for builtins: it patches nothing then, and neither does this.
        if members and getattr(pkg, members[0][0]) is members[0][1]:
            for name, member in members:
                interpreter._patch_attr(pkg, name, member, builder, scope)

    interpreter._patch_builtin = patch_builtin


def _patch_language_once_a_launch():
    """Every call of a nested jit helper makes Triton's interpreter patch triton.language again
    (scanning the helper module's globals for it, then setting some hundred attributes) and never
    restores that scope: the launch's own patches, restored when it ends, already serve it. So a
    helper whose language modules the running launch patched is called inside that launch's scope.
    Its numpy dtype table is also rebuilt at every lookup; it is kept by dtype name instead. Both
    are the same wrappers and dtypes as before, looked up once: about a fifth of the interpreter's
    time in the sampler's tests."""
    import functools

    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    real_patch, real_np_dtype = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "_get_np_dtype", None)
    if not callable(real_patch) or not callable(real_np_dtype) or not hasattr(interpreter, "_LangPatchScope"):
        return

    @functools.cache
    def languages(fn) -> frozenset:
        return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)

    patched: set = set()  # the language modules the running launch has patched so far (empty: none runs)

    def patch_lang(fn):
        if patched:  # a helper inside a launch: Triton drops this scope without restoring it, so
            # what it patches stays patched until the launch ends (triton.language.core, first
            # patched for one of the standard library's helpers, included)
            if languages(fn) <= patched:
                return interpreter._LangPatchScope()
            patched.update(languages(fn))
            return real_patch(fn)
        scope = real_patch(fn)
        patched.update(languages(fn))
        restore = scope.restore

        def restore_and_end():
            patched.clear()
            restore()

        scope.restore = restore_and_end
        return scope

    by_name: dict[str, np.dtype] = {}

    def np_dtype(tt_dtype):
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(scalar, tl.pointer_type):
            return np.dtype(np.uint64)
        found = by_name.get(scalar.name)
        if found is None:
            found = by_name[scalar.name] = real_np_dtype(scalar)
        return found

    interpreter._patch_lang = patch_lang
    interpreter._get_np_dtype = np_dtype


def _skip_discarded_overflow_checks():
    """Triton checks every signed 32-bit add, sub and mul for overflow when sanitize_overflow is on,
    which the interpreter's options turn on: the product again in 64 bits, two comparisons and a
    device_assert. Without debug, device_assert returns before asserting anything, so under the
    interpreter the check's work is thrown away: about a sixth of the sampler tests' time. Off unless
    debug is on, it changes no result."""
    import dataclasses

    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if dataclasses.is_dataclass(options) and getattr(options, "sanitize_overflow", False) and not options.debug:
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


if os.environ.get("TRITON_INTERPRET") == "1":
    _look_up_interpreter_builtins_once()
    _patch_language_once_a_launch()
    _skip_discarded_overflow_checks()


def pytest_addoption(parser, pluginmanager):
    if not pluginmanager.has_plugin("xdist"):
        # pyproject's addopts name pytest-xdist's options: without the plugin (not installed, or
        # `-p no:xdist`) they are accepted and the suite runs in this one process.
        ignored, group = "(pytest-xdist absent: ignored)", parser.getgroup("xdist")
        # _addoption: pytest keeps lowercase short options for plugins, whose way (xdist's own) this is
        group._addoption("-n", "--numprocesses", dest="numprocesses", default=None, help=ignored)
        group.addoption("--dist", dest="dist", default="no", help=ignored)
        group.addoption("--no-loadscope-reorder", dest="loadscopereorder", action="store_false", help=ignored)


def pytest_configure(config):
    from tests.seeds import BASE

    # pytest-xdist's workers inherit the environment: one base seed for the whole run.
    os.environ.setdefault("GRAPHRT_TEST_SEED", str(BASE))


def pytest_terminal_summary(terminalreporter):
    from tests.seeds import BASE

    # at the end, where a failing run's output ends too, and under -q as well (which hides the header)
    terminalreporter.write_line(f"graphrt test seed: {BASE} (GRAPHRT_TEST_SEED={BASE} replays this run)")


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's, unknown without it
def pytest_xdist_auto_num_workers(config):
    """pyproject's `-n auto`: without CUDA a worker a core (at most 4: the slowest file bounds the
    run); with CUDA a worker every two cores (at most 8), sharing the GPU: a GPU run on a fresh
    machine is mostly Triton compiling, on the CPU, and no test times anything (the benchmarks do)."""
    cores = os.cpu_count() or 1
    return max(1, min(cores // 2, 8)) if torch.cuda.is_available() else min(cores, 4)


# The files that take longest on a 2-core CPU machine, slowest first (one `--durations` run).
_SLOWEST_FILES = ("test_rejection_filter.py", "test_smollm2.py", "test_vocab_parallel.py", "test_fuzz_kernels.py",
                  "test_tensor_parallel.py", "test_gemv.py", "test_rejection.py")


def pytest_collection_modifyitems(config, items):
    # pytest-xdist hands whole files to its workers in this order (`--dist loadfile
    # --no-loadscope-reorder`): the slowest first, so that no worker starts one near the end.
    order = {name: i for i, name in enumerate(_SLOWEST_FILES)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.device("cuda")


@pytest.fixture(scope="session", autouse=True)
def _cupti_ready_for_graphs():
    """An empty profiler session before any CUDA graph is captured in this process, as `graphrt
    profile` does: without it some driver stacks miscount the in-process attribution test's
    kernels per TARGET_VERIFY replay."""
    if torch.cuda.is_available():
        from graphrt.profiling.torch_profile import init_cupti_for_cuda_graphs

        init_cupti_for_cuda_graphs()
    yield


@pytest.fixture(scope="module")
def target():
    """The tiny random target checkpoint (CPU, fp32)."""
    from tests.helpers import load, tiny_dir

    return load(tiny_dir())


@pytest.fixture(scope="module")
def draft():
    """Its self-draft: a standalone LM of the target's first layers."""
    from tests.helpers import draft_dir, load

    return load(draft_dir("self"))
