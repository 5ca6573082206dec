"""What the filtered set of graphs costs a batch that filters nothing (CUDA only): TARGET_VERIFY's
graph of both sets (Runtime.graph_sets) replayed alternately with every row on the scratch slot,
CUDA events, us per replay, three rounds; smollm2-135m-shape and llama-1b-shape, B = 1 and 8.

    python scripts/filter_graph_sets.py
"""

import torch

from graphrt import Runtime, SamplingParams
from graphrt.presets import default_checkpoints

for preset in ("smollm2-135m-shape", "llama-1b-shape"):
    t, d, _ = default_checkpoints(None, None, torch.bfloat16, preset=preset, draft_kind="eagle3")
    rt = Runtime.from_pretrained(t, d, num_draft_tokens=3, device="cuda", max_batch_size=8, max_seq_len=512)
    rt.capture(inspect_kernels=False)
    rt.capture(filters=True, inspect_kernels=False)
    rt.generate([[1, 2, 3, 4] * 8] * 8, SamplingParams(max_new_tokens=64, ignore_eos=True))
    sets = rt.graph_sets
    s = rt.state  # every row on the scratch slot, as at capture: no request's state moves
    s.batch_slots.fill_(s.scratch_slot)
    s.batch_num_drafts.zero_()
    s.staged = None
    for B in (1, 8):
        for phase in ("TARGET_VERIFY",):
            res = {}
            for _ in range(3):
                for f in (False, True):
                    g = sets[f].get(phase, B)
                    for _w in range(20):
                        g.replay()
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    for _r in range(200):
                        g.replay()
                    e1.record()
                    torch.cuda.synchronize()
                    s.reset_scratch()
                    res.setdefault(f, []).append(1e3 * e0.elapsed_time(e1) / 200)
            print(f"{preset} {phase} B={B}: unfiltered set {[round(x, 1) for x in res[False]]} us, "
                  f"filtered set {[round(x, 1) for x in res[True]]} us", flush=True)
