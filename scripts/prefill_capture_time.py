"""What Runtime.capture(prefill=True) costs at start-up, with and without prefix caching (RESULTS.md).

    python scripts/prefill_capture_time.py

SmolLM2-135M's shape (random weights) with a random EAGLE-3 head, the runtime's default buckets and
length: the phase graphs, then every prefill shape's graph (with prefix caching each shape twice),
four runtimes in turn (prefix caching on, off, on, off); the first run compiles the kernels, unless
Triton's cache (GRAPHRT_CACHE) already holds them.
"""

from __future__ import annotations

import time

import torch

from graphrt import Runtime
from graphrt.presets import ensure_eagle3_head, ensure_preset


def main() -> int:
    if not torch.cuda.is_available():
        raise SystemExit("prefill_capture_time needs CUDA")
    target = ensure_preset("smollm2-135m-shape", torch.bfloat16)
    draft = ensure_eagle3_head(target, torch.bfloat16)
    for pc in (True, False, True, False):
        rt = Runtime.from_pretrained(str(target), str(draft), prefix_caching=pc)
        t0 = time.perf_counter()
        rt.capture(inspect_kernels=False)
        t1 = time.perf_counter()
        rt.capture(inspect_kernels=False, prefill=True)  # the phases again (warm), then the prefill graphs
        t2 = time.perf_counter()
        g = rt.cycle.graphs
        pre = sum(p.capture_s for p in g.prefills.values())
        print(f"prefix_caching={pc}: phases {t1 - t0:.1f} s; capture(prefill=True) {t2 - t1:.1f} s: "
              f"{g.prefill_precompiled} kernel variants precompiled in {g.prefill_precompile_s:.1f} s, then "
              f"{len(g.prefills)} prefill graphs in {pre:.1f} s", flush=True)
        del rt, g
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
