import os

import torch

# Without a GPU the Triton kernels still run, under Triton's interpreter; the switch must be set
# before any @triton.jit decorator executes, hence here, before graphrt is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


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
