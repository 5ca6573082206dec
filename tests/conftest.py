import os

import torch

# Without a GPU the Triton kernels still run, under Triton's interpreter; the switch must be set
# before any @triton.jit decorator executes, hence here, before graphrt is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


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


if os.environ.get("TRITON_INTERPRET") == "1":
    _look_up_interpreter_builtins_once()


def pytest_report_header(config):
    from tests.seeds import BASE

    return f"graphrt test seed: {BASE} (GRAPHRT_TEST_SEED={BASE} replays this run's random cases)"


def pytest_collection_modifyitems(config, items):
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
