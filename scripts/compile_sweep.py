"""Compile for sm_90, on the CPU, every Triton launch configuration the CPU test suite makes.

The CPU suite runs the kernels under Triton's interpreter, which never type-checks a branch it does
not take: a kernel can pass every CPU test and still fail to compile on a GPU (a variable that a
dead branch retypes, say). tests/test_compile_sm90.py compiles chosen launches; this sweep compiles
all of them. Two steps, on any machine with Triton (no GPU):

    PYTHONPATH=scripts python -m pytest -q -p compile_sweep      # records the launches (a plugin)
    python scripts/compile_sweep.py [--jobs N]                    # compiles each one, lists failures

Launches are recorded by kernel, argument types (tensors by dtype, ints by width), constexpr values
and launch options, one file per test process under $COMPILE_SWEEP_DIR (default
/tmp/compile-sweep). Only graphrt's kernels: those the test files define are left out.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import inspect
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

DIR = Path(os.environ.get("COMPILE_SWEEP_DIR", "/tmp/compile-sweep"))
_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion", "maxnreg", "num_ctas")


def _type(v) -> str:
    import torch

    if isinstance(v, torch.Tensor):
        return "*" + {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
                      torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
                      torch.bool: "i1"}[v.dtype]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -2**31 <= v < 2**31 else "i64"
    if isinstance(v, float):
        return "fp32"
    if v is None:
        return "none"
    raise TypeError(f"an argument of type {type(v).__name__}")


def _plain(v):
    v = getattr(v, "value", v)  # tl.constexpr
    return v if isinstance(v, (int, float, bool, str)) or v is None else repr(v)


def pytest_configure(config):
    """Record each interpreter launch (a pytest plugin: `-p compile_sweep`)."""
    from triton.runtime.interpreter import InterpretedFunction

    seen: set[str] = set()
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        params = inspect.signature(self.fn).parameters
        if self.fn.__module__.startswith("graphrt."):  # not the tests' own kernels
            bound = dict(zip(params, args)) | {k: v for k, v in kwargs.items() if k in params}
            types, constexprs = {}, {}
            for name, p in params.items():
                if "constexpr" in str(p.annotation):
                    constexprs[name] = _plain(bound.get(name, p.default))
                elif name in bound:
                    types[name] = _type(bound[name])
            options = {k: _plain(v) for k, v in kwargs.items() if k in _OPTIONS}
            seen.add(json.dumps([self.fn.__module__, self.fn.__name__, types, constexprs, options], sort_keys=True))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run

    def dump():
        DIR.mkdir(parents=True, exist_ok=True)
        (DIR / f"launches-{os.getpid()}.json").write_text(json.dumps(sorted(seen)))

    atexit.register(dump)


def _compile(record: str) -> str | None:
    """The error compiling one recorded launch for sm_90, or None."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, name, types, constexprs, options = json.loads(record)
    try:
        fn = getattr(importlib.import_module(module), name)
        signature, values = {}, {}
        for i, p in enumerate(fn.params):
            t = "constexpr" if p.is_constexpr else types.get(p.name, "none")
            if t in ("constexpr", "none"):  # a None argument compiles as a constexpr, as at a launch
                default = None if p.default is inspect.Parameter.empty else p.default
                signature[p.name], values[(i,)] = "constexpr", constexprs.get(p.name, default)
            else:
                signature[p.name] = t
        triton.compile(ASTSource(fn=fn, signature=signature, constexprs=values), target=GPUTarget("cuda", 90, 32),
                       options=options)
    except Exception as exc:  # noqa: BLE001 - reported
        return f"{type(exc).__name__}: {exc}"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)  # the workers compile: their kernels must be JIT functions
    records = sorted({r for f in DIR.glob("launches-*.json") for r in json.loads(f.read_text())})
    if not records:
        print(f"no launches recorded in {DIR}: run the suite with the plugin first (module docstring)")
        return 2
    with ProcessPoolExecutor(args.jobs) as pool:
        errors = [(r, e) for r, e in zip(records, pool.map(_compile, records, chunksize=4)) if e]
    for record, error in errors:
        module, name, types, constexprs, _ = json.loads(record)
        print(f"FAILED {module}.{name} {constexprs}\n  {error[:1500]}")
    print(f"{len(records) - len(errors)} of {len(records)} launch configurations compile for sm_90")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
