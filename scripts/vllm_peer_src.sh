#!/usr/bin/env bash
# Builds .vllm_src/ (git-ignored): the few files of vLLM 0.33's published wheel that its speculative
# sampler and its Triton top-k / top-p need, for scripts/vllm_rejection_peer.py. Run once where pip
# can reach PyPI (the GPU machine cannot), then carry .vllm_src to the GPU machine:
#   bash scripts/vllm_peer_src.sh [WHEEL]
# Empty package __init__ files replace vLLM's, and small stand-ins replace the engine modules these
# files import for things the peer never uses (the JIT warmup registry, platform probing, the
# GPU-sync debugger); the stand-in dispatcher binds arguments to the kernel as vLLM's does (by name,
# name_ptr, NAME or NAME_PTR, and *_stride from the bound tensors).
set -euo pipefail
cd "$(dirname "$0")/.."
whl=${1:-}
if [ -z "$whl" ]; then
  mkdir -p /tmp/vllm-whl
  pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
    vllm==0.33.0 -d /tmp/vllm-whl
  whl=$(ls /tmp/vllm-whl/vllm-0.33.0-*.whl)
fi
rm -rf .vllm_src && mkdir -p .vllm_src
files=(vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py vllm/v1/worker/gpu/sample/gumbel.py
       vllm/v1/worker/gpu/sample/watermark.py vllm/v1/spec_decode/fly.py vllm/v1/watermarking/prfs/philox.py
       vllm/v1/watermarking/prfs/base.py vllm/v1/sample/ops/topk_topp_triton.py vllm/utils/math_utils.py)
unzip -q -o "$whl" "${files[@]}" -d .vllm_src
find .vllm_src/vllm -type d -exec sh -c 'touch "$1/__init__.py"' _ {} \;
mkdir -p .vllm_src/vllm/triton_utils .vllm_src/vllm/model_executor/warmup .vllm_src/vllm/platforms
cat > .vllm_src/vllm/triton_utils/__init__.py <<'PY'
import triton
import triton.language as tl
from triton.language.extra import libdevice as tldevice

HAS_TRITON = True
PY
cat > .vllm_src/vllm/platforms/__init__.py <<'PY'
class _Cuda:
    @staticmethod
    def is_cuda_alike():
        return True


current_platform = _Cuda()
PY
cat > .vllm_src/vllm/utils/gpu_sync_debug.py <<'PY'
import contextlib


@contextlib.contextmanager
def gpu_sync_allowed():
    yield
PY
cat > .vllm_src/vllm/utils/platform_utils.py <<'PY'
import torch


def num_compute_units(index=None):
    if not torch.cuda.is_available():
        return 4
    return torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index).multi_processor_count
PY
cat > .vllm_src/vllm/model_executor/warmup/jit_warmup.py <<'PY'
# Stand-ins: only the warmup-input builders use these, and the peer never calls them.
WarmupChoices = WarmupIntRange = lambda *a, **k: None


def _when(*a, **k):
    return None
PY
cat > .vllm_src/vllm/model_executor/warmup/jit_warmup_triton_helper.py <<'PY'
import inspect

DispatchSpec = tuple
TritonWarmupTensor = lambda *a, **k: None  # noqa: E731


def triton_kernel_dispatcher_with_warmup(*, warmup_inputs, kernel=None):
    def decorate(dispatch):
        names = tuple(inspect.signature(dispatch).parameters)

        def launch(*args, **kwargs):
            spec = dispatch(*args, **kwargs)
            grid, launch_kwargs = spec[0], dict(spec[1])
            bound = inspect.signature(dispatch).bind(*args, **kwargs)
            bound.apply_defaults()
            arg_names = set(kernel.arg_names)
            for name in names:
                for target in (name, f"{name}_ptr", name.upper(), f"{name}_ptr".upper()):
                    if target in arg_names and target not in launch_kwargs:
                        launch_kwargs[target] = bound.arguments[name]
                        break
            for target in kernel.arg_names:
                if target in launch_kwargs:
                    continue
                for sep, suffix in (("_stride", "_ptr"), ("_STRIDE", "_PTR")):
                    base, found, dim = target.rpartition(sep)
                    dim = dim.removeprefix("_")
                    if found and (not dim or dim.isdigit()):
                        src = base if base in launch_kwargs else base + suffix
                        if src in launch_kwargs:
                            launch_kwargs[target] = launch_kwargs[src].stride(int(dim or 0))
            kernel[grid](**launch_kwargs)
            return spec[2] if len(spec) == 3 else None

        return launch

    return decorate
PY
echo ".vllm_src ready ($(find .vllm_src -name '*.py' | wc -l) files)"
