"""Compile Triton kernels for sm_90 without a GPU (Triton's own ptxas), so CI catches what the
interpreter cannot: frontend and lowering errors that only show when a kernel is compiled (a second
`return` after a taken constexpr branch, say). Covers the launch configurations the GEMV dispatcher
uses, with and without PDL (griddepcontrol must reach the PTX only when asked). Runs in a
subprocess: the test session itself has TRITON_INTERPRET=1 on a CPU machine (tests/conftest.py)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

CONFIGS = {
    # M = 1: the FMA path with per-step reduction (every projection), PDL (weight tile read before the wait)
    "fma-m1-pdl": dict(BLOCK_M=1, BLOCK_N=2, BLOCK_K=2048, USE_DOT=False, REDUCE_EACH=True, HAS_BIAS=False,
                       SPLIT=False, FUSED=False, RED_M=1, USE_PDL=True),
    # M = 2: FMA without per-step reduction, split K fused, bias, no PDL
    "fma-m2-split": dict(BLOCK_M=2, BLOCK_N=4, BLOCK_K=1024, USE_DOT=False, REDUCE_EACH=False, HAS_BIAS=True,
                         SPLIT=True, FUSED=True, RED_M=2, USE_PDL=False),
    # M = 3..16: the tensor-core path, split K 4 fused, PDL
    "dot-m16-pdl": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, USE_DOT=True, REDUCE_EACH=False, HAS_BIAS=False,
                        SPLIT=True, FUSED=True, RED_M=16, USE_PDL=True),
}

_SCRIPT = textwrap.dedent("""
    import inspect, json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from graphrt.kernels import gemv

    types = dict(x_ptr="*bf16", w_ptr="*bf16", bias_ptr="*bf16", y_ptr="*bf16", ws_ptr="*fp32",
                 ctr_ptr="*i32", M="i32", N="i32", K="i32", stride_xm="i32", stride_ym="i32",
                 K_PER_SPLIT="i32", SPLIT_K="i32")
    fn = gemv._gemv_kernel
    params = list(inspect.signature(fn.fn).parameters)
    out = {}
    for name, cfg in json.loads(sys.argv[1]).items():
        cfg["DOT_PRECISION"] = "tf32"
        src = ASTSource(fn=fn, signature={p: types.get(p, "constexpr") for p in params},
                        constexprs={(params.index(k),): v for k, v in cfg.items()})
        try:
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                               options=dict(num_warps=4, num_stages=4 if cfg["USE_DOT"] else 1))
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            continue
        ptx = k.asm["ptx"]
        out[name] = {"sm_90": ".target sm_90" in ptx, "griddepcontrol": "griddepcontrol.wait" in ptx}
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(CONFIGS)], env=env, capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != 0:
        if "ptxas" in proc.stderr.lower() or "No module named 'triton" in proc.stderr:
            pytest.skip(f"Triton cannot compile for sm_90 here: {proc.stderr[-500:]}")
        raise AssertionError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gemv_compiles_for_sm90(compiled, name):
    res = compiled[name]
    assert "error" not in res, res.get("error")
    assert res["sm_90"]
    assert res["griddepcontrol"] == CONFIGS[name]["USE_PDL"]
