"""`graphrt bench`: decode throughput, acceptance length and per-phase time.

With no arguments it runs an embedded random model (tiny on CPU, llama-1b-shape on CUDA) with a
self-draft, so a fresh machine needs no download.
"""

from __future__ import annotations

import json
import time

import torch
from tqdm import tqdm

from graphrt.arg_types import device_and_dtype, draft_kind
from graphrt.errors import GraphrtError
from graphrt.floors import lm_bytes, phase_bytes
from graphrt.parallel import join_ranks, rank_zero_first
from graphrt.params import SamplingParams
from graphrt.profiling.phase_timer import PhaseTimer
from graphrt.profiling.phases import PREFILL
from graphrt.runtime import Runtime


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_decode(rt: Runtime, batch_size: int, *, prompt_len: int, max_new_tokens: int, seed: int = 0,
               prompts: list[list[int]] | None = None, temperature: float = 0.0) -> dict:
    """Decode of `batch_size` prompts, greedy unless a temperature is given; timing covers the
    decode cycles only. prompts None: random ones of prompt_len tokens, decoded past any EOS;
    given: their first batch_size, each stopping at its EOS as a real request does."""
    if prompts is None:
        g = torch.Generator().manual_seed(seed)
        prompts = torch.randint(0, rt.vocab_size, (batch_size, prompt_len), generator=g).tolist()
        ignore_eos = True
    else:
        prompts, ignore_eos = prompts[:batch_size], False
    params = [SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos, temperature=temperature,
                             seed=seed + i) for i in range(len(prompts))]
    rids = [rt.add_request(p, sp) for p, sp in zip(prompts, params)]
    rt.admit()  # the prefill, outside the timing
    timer = PhaseTimer(rt.device)
    rt.cycle.timer = timer
    _sync(rt.device)
    host0, cycles0 = rt.host_seconds, rt.num_cycles
    t0 = time.perf_counter()
    while rt.has_unfinished():
        rt.step()
    _sync(rt.device)
    elapsed = time.perf_counter() - t0
    rt.cycle.timer = None
    cycles = rt.num_cycles - cycles0
    host_us = 1e6 * (rt.host_seconds - host0) / max(cycles, 1)
    phases = timer.summary()
    full = timer.largest_batch_us()
    gens = [rt.get_generation(r) for r in rids]
    decoded = sum(len(x.token_ids) - 1 for x in gens)  # the first token of each came from prefill
    gpu_cycles = sum(x.num_cycles for x in gens) / len(gens)
    return {"batch_size": batch_size, "tokens": decoded, "seconds": elapsed, "tokens_per_s": decoded / elapsed,
            "cycles": cycles, "cycle_ms": 1e3 * elapsed / max(cycles, 1),
            "mean_acceptance_length": decoded / max(gpu_cycles * len(gens), 1), "host_us_per_cycle": host_us,
            "gpu_us_per_cycle": 1e3 * sum(p["total_ms"] for p in phases.values()) / max(cycles, 1), "phases": phases,
            "full_bucket_us": full, "full_cycle_us": sum(full.values())}


def run_served(rt: Runtime, concurrency: int, prompts: list[list[int]], *, num_requests: int, max_new_tokens: int,
               temperature: float = 0.0, seed: int = 0) -> dict:
    """num_requests prompts (prompts' list, cycled) through `concurrency` slots, as a serving engine
    runs them: a new request joins as soon as one finishes, each stopping at its EOS. run_decode's
    batch ends with its slowest request, which under speculation is the one whose drafts the target
    accepted least; here the slots stay full. Throughput is counted in the steady state, up to the
    last request's admission: tokens per cycle (the cycles the host has read) over the decode phases'
    GPU time per cycle (every launched cycle's, from the phase timer's events), so the prefill of
    each joining request stays out of it. The wall-clock figure counts everything, prefill included,
    and so do the latencies a client sees: time to the first token (from add_request to the step()
    that returns it) and time per later token (to the step() that returns the last), in ms."""
    if concurrency < 1 or num_requests < 2 * concurrency:  # else the steady state is over at once
        raise GraphrtError(f"run_served: need concurrency >= 1 ({concurrency}) and num_requests >= twice it "
                           f"({num_requests})")
    queue = [prompts[i % len(prompts)] for i in range(num_requests)]
    rids: list[int] = []
    added, first, last = {}, {}, {}  # request id -> perf_counter at add_request, first and last token

    def admit():
        running = sum(not rt.finished(r) for r in rids)
        while queue and running < concurrency:
            sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + len(rids))
            rids.append(rt.add_request(queue.pop(0), sp))
            added[rids[-1]] = time.perf_counter()
            running += 1

    timer = PhaseTimer(rt.device)
    rt.cycle.timer = timer
    _sync(rt.device)
    t0, cycles0, read = time.perf_counter(), rt.num_cycles, 0
    admit()
    steady = None
    while rt.has_unfinished() or queue:
        read += rt.has_unfinished()  # then step() reads one cycle
        out = rt.step()
        now = time.perf_counter()
        for rid in out:
            first.setdefault(rid, now)
            last[rid] = now
        admit()
        if not queue and steady is None:
            phases = timer.summary()  # waits for the cycles in flight: once
            launched = rt.num_cycles - cycles0
            decode_ms = sum(p["total_ms"] for name, p in phases.items() if name != PREFILL)
            gens = [rt.get_generation(r) for r in rids]
            steady = {"cycles": read, "tokens": sum(len(g.token_ids) - 1 for g in gens),
                      "mean_batch": sum(g.num_cycles for g in gens) / max(read, 1),
                      "gpu_us_per_cycle": 1e3 * decode_ms / max(launched, 1), "launched": launched}
    _sync(rt.device)
    elapsed = time.perf_counter() - t0
    phases = timer.summary()
    rt.cycle.timer = None
    gens = [rt.pop_generation(r) for r in rids]
    decoded = sum(len(g.token_ids) - 1 for g in gens)
    per_cycle = steady["tokens"] / max(steady["cycles"], 1)
    prefill = phases.get(PREFILL, {"total_ms": 0.0, "calls": 0})
    ttft = sorted(1e3 * (first[r] - added[r]) for r in rids)
    tpot = [1e3 * (last[r] - first[r]) / (len(g.token_ids) - 1) for r, g in zip(rids, gens) if len(g.token_ids) > 1]
    return {"concurrency": concurrency, "requests": num_requests, "tokens": decoded,
            "tokens_per_s": 1e6 * per_cycle / steady["gpu_us_per_cycle"],
            "tokens_per_s_wall": decoded / elapsed,
            # where the wall clock went: the GPU time of the decode phases and of the prefills (each
            # a forward over the requests admitted together); the rest is the host's
            "wall_s": elapsed, "prefills": prefill["calls"], "prefill_gpu_s": prefill["total_ms"] / 1e3,
            "decode_gpu_s": sum(p["total_ms"] for name, p in phases.items() if name != PREFILL) / 1e3,
            "mean_batch": sum(g.num_cycles for g in gens) / max(rt.num_cycles - cycles0, 1),
            "mean_acceptance_length": decoded / max(sum(g.num_cycles for g in gens), 1),
            "ttft_ms": {"mean": sum(ttft) / len(ttft), "p50": ttft[len(ttft) // 2],
                        "p99": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))]},
            "tpot_ms_mean": sum(tpot) / max(len(tpot), 1),
            "steady": steady}


def run_prefill(rt: Runtime, prompts: list[list[int]], num_requests: int, *, repeats: int = 5) -> dict:
    """What admitting num_requests waiting requests at once costs (one prefill forward over the
    prompts, cycled from prompts): the host's wall clock for admit(), which waits for the first
    tokens, and the prefill's GPU time, means over `repeats` admissions after a warm-up one. The
    requests are aborted after each, so the runtime needs num_requests free slots. Under prefix
    caching a prompt that comes again is found cached: to time whole prefills, give new prompts or
    a runtime without it."""
    timer = PhaseTimer(rt.device)
    wall, tokens = [], 0
    for i in range(repeats + 1):
        batch = [prompts[(i * num_requests + j) % len(prompts)] for j in range(num_requests)]
        tokens += sum(map(len, batch)) if i else 0
        rids = [rt.add_request(p, SamplingParams(max_new_tokens=2)) for p in batch]
        _sync(rt.device)
        rt.cycle.timer = timer if i else None
        t0 = time.perf_counter()
        rt.admit()
        if i:
            wall.append(time.perf_counter() - t0)
        rt.cycle.timer = None
        if len(rt.running_slots()) != num_requests:
            raise GraphrtError(f"run_prefill: {num_requests} requests need as many free slots and their KV")
        for r in rids:
            rt.abort(r)
            rt.pop_generation(r)
    gpu = timer.summary().get(PREFILL, {"total_ms": 0.0})["total_ms"] / repeats
    return {"requests": num_requests, "wall_ms": 1e3 * sum(wall) / repeats, "gpu_ms": gpu,
            "prompt_tokens": tokens / repeats}  # a mean admission's


def rooflines(rt, bandwidth_gbs: float) -> dict[str, float]:
    """Per-phase floor in microseconds: the phase's weight bytes (graphrt/floors.py) read once at
    the measured bandwidth."""
    dtype_bytes = rt.target_ckpt.weights["embed_tokens.weight"].element_size()
    draft = rt.draft_ckpt.config if rt.draft_ckpt is not None else None
    tp = rt.tp.world_size if rt.tp is not None else 1
    return {phase: nbytes / (bandwidth_gbs * 1e3)
            for phase, nbytes in phase_bytes(rt.target_ckpt.config, draft, rt.K, dtype_bytes, tp,
                                             bool(_draft_split(rt)), 1 if rt.draft_quantization else None).items()}


def _draft_split(rt) -> bool | None:
    """Whether rt's draft is split over the tensor-parallel ranks; None without a draft."""
    return None if rt.draft_ckpt is None else rt.draft_ckpt.parallel is not None


def main(args) -> list[dict]:
    from graphrt.presets import default_checkpoints

    device, dtype = device_and_dtype(args)
    on_cuda = device.type == "cuda"
    batch_sizes = args.batch_sizes or ([1, 2, 4, 8, 16, 32, 64] if on_cuda else [1, 4])
    max_new = args.max_new_tokens or (128 if on_cuda else 32)
    if args.target is None:
        preset = args.preset or ("llama-1b-shape" if on_cuda else "tiny")
        cut = f", first {args.layers} layers" if args.layers else ""
        print(f"graphrt bench: embedded random preset {preset!r} ({str(dtype).split('.')[-1]}, {device}{cut})")
    tp = join_ranks(args.tp)
    with rank_zero_first(tp):
        target, draft, draft_desc = default_checkpoints(args.target, args.draft, dtype, no_draft=args.no_draft,
                                                        draft_layers=args.draft_layers, preset=args.preset,
                                                        damped=args.damped, draft_kind=draft_kind(args, device),
                                                        preset_layers=args.layers)
    if draft and args.draft_quantization:
        draft_desc += f"; {args.draft_quantization.upper()} weights"
    if args.sweep_accept:
        if not draft:
            raise GraphrtError("--sweep-accept needs a draft")
        return sweep_acceptance(args, target, draft, draft_desc, device=device, dtype=dtype,
                                batch_sizes=args.batch_sizes or ([1, 8, 64] if on_cuda else [1, 4]),
                                max_new=max_new, graphs=on_cuda and not args.eager, tp=tp)
    max_bs = max(batch_sizes)
    seq = args.prompt_len + max_new + 8
    kw = dict(device=device, dtype=dtype, max_batch_size=max_bs, max_seq_len=seq, tensor_parallel_size=args.tp)
    graphs = on_cuda and not args.eager
    runtimes = []
    simulated = args.accept_len
    if draft:
        spec_kw = dict(num_draft_tokens=args.num_draft_tokens, simulate_acceptance_length=simulated,
                       draft_quantization=args.draft_quantization)
        spec = Runtime.from_pretrained(target, draft, use_cuda_graphs=graphs, **spec_kw, **kw)
        runtimes.append(("spec-graphs" if graphs else "spec-eager", spec))
        base = spec.target_ckpt
        if graphs:  # the same cycle without graphs, for the graph speed-up
            runtimes.append(("spec-eager", Runtime(spec.target_ckpt, spec.draft_ckpt, use_cuda_graphs=False,
                                                   device=device, max_batch_size=max_bs, max_seq_len=seq,
                                                   tensor_parallel=tp, **spec_kw)))
    else:
        base = target
    plain = Runtime.from_pretrained(base, None, use_cuda_graphs=graphs, **kw)
    runtimes.append(("plain-graphs" if graphs else "plain-eager", plain))
    for name, rt in runtimes:
        if rt.use_cuda_graphs:
            t0 = time.perf_counter()
            recs = rt.capture(inspect_kernels=False)
            print(f"{name}: captured {len(recs)} graphs in {time.perf_counter() - t0:.1f} s")

    results = []
    jobs = [(m, rt, b) for m, rt in runtimes for b in batch_sizes]
    for mode, rt, b in tqdm(jobs, desc="bench", unit="run", disable=len(jobs) < 3):
        run_decode(rt, b, prompt_len=args.prompt_len, max_new_tokens=min(8, max_new))  # warm-up
        r = run_decode(rt, b, prompt_len=args.prompt_len, max_new_tokens=max_new)
        r["mode"] = mode
        results.append(r)

    bandwidth = None
    if on_cuda:
        from graphrt.kernels.timing import memory_bandwidth_gbs

        bandwidth = memory_bandwidth_gbs()
        for r in results:
            rt = dict(runtimes)[r["mode"]]
            for phase, floor in rooflines(rt, bandwidth).items():
                if phase in r["phases"]:  # of a launch at the batch's bucket (full_bucket_us), not of mean_us
                    r["phases"][phase]["floor_us"] = floor
                    r["phases"][phase]["roofline_share"] = floor / r["full_bucket_us"][phase]

    if simulated is not None:
        print(f"simulated acceptance {simulated:g}: each verify step accepts a drawn number of drafts "
              f"(mean tokens per cycle {simulated:g}); costs are the real cycle's, tokens are not the target's")
    tp_note = f"; {_tp_desc(tp, plain, _draft_split(runtimes[0][1]))}" if tp else ""
    print(f"draft: {draft_desc or 'none'}; K = {args.num_draft_tokens}; prompt {args.prompt_len}, "
          f"{max_new} new tokens per request, greedy" + (f"; bandwidth {bandwidth:.0f} GB/s" if bandwidth else "")
          + tp_note + "; phases: GPU us a launch at the batch's own bucket")
    phase_names = ["TARGET_VERIFY", "DRAFT_EXTEND", "DRAFT_DECODE", "TARGET_DECODE"]
    head = (f"{'mode':<12} {'B':>4} {'tok/s':>10} {'cycle ms':>9} {'host us':>8} {'gpu us':>8} {'accept len':>10}  "
            + "  ".join(f"{p + ' us (roof)':>24}" for p in phase_names))
    print(head)
    for r in results:
        cells = []
        for p in phase_names:
            ph = r["phases"].get(p)
            if ph is None:
                cells.append(f"{'-':>24}")
            elif "roofline_share" in ph:
                cells.append(f"{r['full_bucket_us'][p]:>15.1f} ({100 * ph['roofline_share']:>4.0f}%)")
            else:  # no bandwidth on the CPU, so no roofline
                cells.append(f"{r['full_bucket_us'][p]:>24.1f}")
        print(f"{r['mode']:<12} {r['batch_size']:>4} {r['tokens_per_s']:>10.1f} {r['cycle_ms']:>9.2f} "
              f"{r['host_us_per_cycle']:>8.0f} {r['gpu_us_per_cycle']:>8.0f} {r['mean_acceptance_length']:>10.2f}  "
              + "  ".join(cells))
    by_mode = {(r["mode"], r["batch_size"]): r for r in results}
    pairs = [(sp, by_mode["plain" + m[4:], b]) for (m, b), sp in by_mode.items()
             if m.startswith("spec") and ("plain" + m[4:], b) in by_mode]
    if pairs:
        print("speedup over plain decoding, static batch (the tok/s above) / served (every slot kept busy):")
        for sp, pl in pairs:
            print(f"  {sp['mode']:<12} {sp['batch_size']:>4} {sp['tokens_per_s'] / pl['tokens_per_s']:>6.2f}x / "
                  f"{served_speedup(sp, pl):.2f}x")

    peers = []
    if args.peers and on_cuda:
        from graphrt.peers import run_hf

        peers = run_hf(target, draft, batch_sizes=[b for b in batch_sizes if b in (1, 8, 64)],
                       prompt_len=args.prompt_len, new_tokens=max_new, num_draft_tokens=args.num_draft_tokens)
        ours = {(r["mode"], r["batch_size"]): r["tokens_per_s"] for r in results}
        print(f"{'peer':<18} {'B':>4} {'tok/s':>10} {'accept len':>10}  graphrt plain-graphs / peer   "
              "spec-graphs / peer")
        for p in peers:
            pl, sp = ours.get(("plain-graphs", p["batch_size"])), ours.get(("spec-graphs", p["batch_size"]))
            r_pl, r_sp = ((x or float("nan")) / p["tokens_per_s"] for x in (pl, sp))
            acc = p.get("mean_acceptance_length")
            acc = f"{acc:>10.2f}" if acc is not None else f"{'-':>10}"
            print(f"{p['mode']:<18} {p['batch_size']:>4} {p['tokens_per_s']:>10.1f} {acc}  {r_pl:>27.2f}x  "
                  f"{r_sp:>17.2f}x")
    if draft_desc.startswith("random ") and simulated is None:
        print("note: the embedded draft has random weights, so it accepts next to nothing (acceptance length "
              "about 1): this shows speculation's cost, not its gain. For the speedup at a known acceptance: "
              "--accept-len L or --sweep-accept; a real target with its trained head: scripts/bench_real_pair.py")
    if bandwidth:
        t_bytes = lm_bytes(plain.target_ckpt.config, plain.target_ckpt.weights["embed_tokens.weight"].element_size())
        print(f"weight-read roofline for plain decode at B=1: {bandwidth * 1e9 / t_bytes:.0f} tok/s "
              f"({t_bytes / 2**30:.2f} GiB of weights)")
    if args.png:
        write_png(results, args.png, title=f"graphrt bench: {target}\ndraft: {draft_desc}")
    if args.json_out:
        meta = run_meta(device, draft=draft_desc, num_draft_tokens=args.num_draft_tokens, target=str(target),
                        bandwidth_gbs=bandwidth, simulated_acceptance=simulated)
        with open(args.json_out, "w") as f:
            json.dump({"meta": meta, "results": results, "peers": peers}, f, indent=2)
    return results


def run_meta(device, **extra) -> dict:
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), **extra}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    return meta


SWEEP_PHASES = ("TARGET_VERIFY", "DRAFT_EXTEND", "DRAFT_DECODE")


def sweep_acceptance(args, target, draft, draft_desc, *, device, dtype, batch_sizes, max_new, graphs,
                     tp=None) -> list[dict]:
    """Tokens/s against simulated acceptance length L in 1, 1.5, .., K + 1 for each K, with plain
    decoding of the same target measured in the same process beside each row, the speedup (static
    batch and served, see served_speedup), the break-even L of each and per-phase time: what
    speculation buys at each acceptance a draft may reach."""
    from graphrt.checkpoint import load_checkpoint

    Ks = args.sweep_k or ([3, 5] if device.type == "cuda" else [3])
    kw = dict(device=device, max_batch_size=max(batch_sizes), max_seq_len=args.prompt_len + max_new + 8,
              use_cuda_graphs=graphs)
    run = dict(prompt_len=args.prompt_len, max_new_tokens=max_new)
    plain = Runtime.from_pretrained(target, None, dtype=dtype, tensor_parallel_size=args.tp, **kw)
    tckpt, dckpt = plain.target_ckpt, load_checkpoint(draft, dtype=dtype, device=device)
    kw["tensor_parallel"] = plain.tp
    base = {}
    for b in batch_sizes:
        run_decode(plain, b, prompt_len=args.prompt_len, max_new_tokens=min(8, max_new))  # warm-up
        base[b] = run_decode(plain, b, **run)
    rows = []
    for K in Ks:
        spec = Runtime(tckpt, dckpt, num_draft_tokens=K, simulate_acceptance_length=1.0,
                       draft_quantization=args.draft_quantization, **kw)
        for b in batch_sizes:
            run_decode(spec, b, prompt_len=args.prompt_len, max_new_tokens=min(8, max_new))
            for L in [1.0 + i / 2 for i in range(2 * K + 1)]:
                spec.set_simulated_acceptance(L)
                r = run_decode(spec, b, **run)
                rows.append({"K": K, "batch_size": b, "L": L, "measured_L": r["mean_acceptance_length"],
                             "tokens_per_s": r["tokens_per_s"], "plain_tokens_per_s": base[b]["tokens_per_s"],
                             "speedup": r["tokens_per_s"] / base[b]["tokens_per_s"],
                             "served_speedup": served_speedup(r, base[b]),
                             "phases_us": {p: r["full_bucket_us"][p] for p in SWEEP_PHASES if p in r["full_bucket_us"]},
                             "plain_step_us": base[b]["full_bucket_us"]["TARGET_DECODE"]})
        split = _draft_split(spec)
        del spec
    even, even_served = break_even(rows), break_even(rows, "served_speedup")
    print(f"graphrt bench --sweep-accept: simulated acceptance L (each verify step accepts a drawn number of "
          f"drafts, mean tokens per cycle L; the target forward and rejection kernel run as always)\n"
          f"target: {target}\ndraft: {draft_desc}\n{max_new} new tokens per request, prompt {args.prompt_len}, "
          f"greedy, {'graphs' if graphs else 'eager'}, {device}"
          + (f", {_tp_desc(tp, plain, split)}" if tp else "")
          + "\nspeedup: the static batch's tokens/s (its requests start together, and the batch runs until the "
          "slowest ends); served: every slot kept busy, as a continuous-batching server runs them")
    print(f"{'K':>2} {'B':>4} {'L':>4} {'meas L':>6} {'spec tok/s':>11} {'plain tok/s':>11} {'speedup':>7} "
          f"{'served':>7}  "
          + "  ".join(f"{p + ' us':>16}" for p in SWEEP_PHASES) + f"  {'plain step us':>13}")
    for r in rows:
        print(f"{r['K']:>2} {r['batch_size']:>4} {r['L']:>4.1f} {r['measured_L']:>6.2f} {r['tokens_per_s']:>11.1f} "
              f"{r['plain_tokens_per_s']:>11.1f} {r['speedup']:>6.2f}x {r['served_speedup']:>6.2f}x  "
              + "  ".join(f"{r['phases_us'].get(p, float('nan')):>16.1f}" for p in SWEEP_PHASES)
              + f"  {r['plain_step_us']:>13.1f}")

    def show(L):
        return f"L = {L:.2f}" if L is not None else "not reached"

    for (K, b), L in sorted(even.items()):
        print(f"break-even at K = {K}, B = {b}: {show(L)} (served: {show(even_served[K, b])})")
    if args.png:
        write_sweep_png(rows, args.png, title=f"graphrt bench --sweep-accept: {target}\ndraft: {draft_desc}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"meta": run_meta(device, draft=draft_desc, target=str(target), simulated_acceptance="sweep"),
                       "rows": rows, "break_even": [{"K": K, "batch_size": b, "L": L, "L_served": even_served[K, b]}
                                                    for (K, b), L in sorted(even.items())]}, f, indent=2)
    return rows


def served_speedup(spec: dict, plain: dict) -> float:
    """The speedup over plain decoding with every slot kept busy, from two run_decode results of one
    batch size: tokens per request-cycle (the measured acceptance length) over the GPU time of a
    cycle at the batch's bucket, against one token a request over the GPU time of a plain step.
    This is run_served's steady-state measure, as a continuous-batching server keeps its slots full.
    run_decode's own tokens/s also pays for the static batch's tail: its requests draw their
    acceptance apart, and those that finish early idle in their slots until the slowest ends.
    Plain decoding has no tail: its requests all end at the same step."""
    return spec["mean_acceptance_length"] * plain["full_cycle_us"] / spec["full_cycle_us"]


def speedup_curves(rows: list[dict], key: str = "speedup") -> dict[tuple[int, int], list[tuple[float, float]]]:
    """(K, B) -> [(measured acceptance length, row[key])] ascending, in the sweep's (K, B) order: at
    the mean length each run measured, since a short run's draws miss the set L by a few percent."""
    curves: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for r in rows:
        curves.setdefault((r["K"], r["batch_size"]), []).append((r["measured_L"], r[key]))
    return {kb: sorted(pts) for kb, pts in curves.items()}


def break_even(rows: list[dict], key: str = "speedup") -> dict[tuple[int, int], float | None]:
    """(K, B) -> the acceptance length where row[key] crosses 1 (linear between the swept points of
    speedup_curves; 1.0 when speculation already pays at L = 1; None when it never does)."""
    out = {}
    for kb, pts in speedup_curves(rows, key).items():
        out[kb] = None
        if pts[0][1] >= 1:
            out[kb] = pts[0][0]
            continue
        for (l0, s0), (l1, s1) in zip(pts, pts[1:]):
            if s0 < 1 <= s1:
                out[kb] = l0 + (1 - s0) * (l1 - l0) / (s1 - s0)
                break
    return out


def write_sweep_png(rows: list[dict], path, *, title: str = "") -> None:
    """Speedup over plain decoding against the measured mean acceptance length of each simulated
    run, one line per (K, B): the static batch's on the left, served (served_speedup) on the right."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, key, name in zip(axes, ("speedup", "served_speedup"),
                             ("static batch (requests start together)", "served (every slot kept busy)")):
        for (K, b), pts in speedup_curves(rows, key).items():
            ax.plot(*zip(*pts), marker="o", linestyle="-" if K == 3 else "--", label=f"K = {K}, B = {b}")
        ax.axhline(1.0, color="gray", linewidth=0.8)
        _style(ax, name, "acceptance length L (tokens per cycle, simulated; as measured)",
               "speedup over plain decoding" if key == "speedup" else None, legend_size=7)
    fig.suptitle(title, fontsize=8)
    _save(plt, fig, path)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise GraphrtError("--png needs matplotlib: `pip install matplotlib`") from None
    return plt


def _style(ax, title, xlabel, ylabel, *, legend_size, which="major") -> None:
    ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=8)
    ax.grid(True, which=which, alpha=0.3)
    ax.legend(fontsize=legend_size)


def _save(plt, fig, path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)



def write_png(results: list[dict], path, *, title: str = "") -> None:
    """Tokens/s against batch size, one line per mode."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for mode in dict.fromkeys(r["mode"] for r in results):
        rows = sorted((r for r in results if r["mode"] == mode), key=lambda r: r["batch_size"])
        ax.plot([r["batch_size"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    sizes = sorted({r["batch_size"] for r in results})
    ax.set_xticks(sizes, [str(b) for b in sizes])
    _style(ax, title, "batch size", "decode tokens/s", legend_size=8, which="both")
    _save(plt, fig, path)


def _tp_desc(tp, rt, draft_split: bool | None = None) -> str:
    """rt: a runtime of the run (its all-reduce path); draft_split: whether the speculative
    runtime's draft is split over the ranks (None: no draft)."""
    draft = "" if draft_split is None else ", draft split over the ranks" if draft_split else ", draft replicated"
    return f"tensor parallel over {tp.world_size} ranks, all-reduce {rt.all_reduce_path}{draft}"
