"""Kernel families for the profile chart: GEMV, GEMM, attention, norm, rotary, sampler, argmax,
bookkeeping (the cycle's own index launches), comm, other.

Classified from the kernel's name alone (the trace has nothing else), first match wins. The order
matters where graphrt fuses: `_qkv_rotary_kernel` is the M = 1 qkv projection with rotary and the
KV store in its epilogue, so it streams weights like a GEMV and is counted as one, while
`_rotary_store_kv_kernel` (rotary + KV store after a cuBLAS qkv) is rotary. cuBLAS's skinny
products (`nvjet_*`, `gemv*`) keep the family their name says, whatever M was.
"""

from __future__ import annotations

import functools
import re

from graphrt.profiling.attribution import short_kernel_name

FAMILIES = ("GEMV", "GEMM", "attention", "norm", "rotary", "sampler", "argmax", "bookkeeping", "comm", "other")

_RULES = [
    # tensor parallelism's collectives: NCCL's kernels are ncclDevKernel_AllReduce_Sum_bf16_RING_LL...
    ("comm", r"^nccl|all_?reduce|all_?gather|reduce_?scatter|cross_device"),
    ("GEMV", r"gemv|qkv_rotary"),
    ("rotary", r"rotary|rope"),
    ("attention", r"attn|attention|flash|fmha|store_kv|kv_cache"),
    ("norm", r"rms_?norm|layer_?norm|norm_kernel"),
    ("argmax", r"argmax"),
    # kernels/rejection.py and kernels/simulated_acceptance.py name theirs _row_stats, _walk,
    # _race, _finish and _simulate, kernels/vocab_parallel_kernels.py _assemble; softmax and top-k
    # only ever run to sample here
    ("sampler", r"rejection|sampl|gumbel|multinomial|softmax|topk|top_k"
                r"|^_(row_stats|walk|race|finish|simulate|assemble)_kernel"),
    ("GEMM", r"gemm|nvjet|cutlass|xmma|cublas|matmul|wgmma|^sm\d+_"),
    # kernels/cycle_index.py: each phase's inputs by slot, and the requests' advance after the sampler
    ("bookkeeping", r"^_(cycle_inputs|advance)_kernel"),
]
_COMPILED = [(family, re.compile(pattern, re.IGNORECASE)) for family, pattern in _RULES]
# Generic kernels named by their template arguments: torch.argmax runs a reduce_kernel over
# ArgMaxOps, CUTLASS GEMMs are cutlass::Kernel2<...gemm...>
_TEMPLATE_RULES = [("argmax", re.compile(r"ArgMaxOps")), ("GEMM", re.compile(r"gemm|cutlass", re.IGNORECASE))]


@functools.lru_cache(maxsize=4096)
def kernel_family(name: str) -> str:
    """The family of a kernel, from its full (demangled) or short name. The rules read the short
    name first: template arguments of torch's elementwise kernels name whatever functor they apply."""
    short = short_kernel_name(name)
    for family, rx in _COMPILED:
        if rx.search(short):
            return family
    for family, rx in _TEMPLATE_RULES:
        if rx.search(name):
            return family
    return "other"
