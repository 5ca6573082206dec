"""graphrt: a speculative-decoding decode runtime built on CUDA graphs and Triton kernels."""

try:
    import graphrt.kernels  # noqa: F401  (a sibling folder mapped into this namespace at install)
except ModuleNotFoundError as exc:  # pragma: no cover - depends on how the package was installed
    if exc.name not in ("graphrt.kernels",):
        raise
    raise ImportError(
        "graphrt.kernels is not importable: graphrt's kernels/, capture/ and profiling/ folders are "
        "mapped into the graphrt namespace at install time. Install with `pip install -e .` from the "
        "checkout, or import graphrt from outside the checkout after `pip install .`."
    ) from exc

from graphrt.params import Generation, RuntimeStats, SamplingParams  # noqa: E402
from graphrt.runtime import Runtime  # noqa: E402

__all__ = ["Runtime", "SamplingParams", "Generation", "RuntimeStats"]
__version__ = "0.1.0"
