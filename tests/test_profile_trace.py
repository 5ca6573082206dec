"""`graphrt profile --trace` and `--png`: the Chrome trace-event file checked against the format
(required keys, a stack of properly nested slices per track, kernels inside their launch, waits
inside their kernel), the kernel-family classifier, and the chart's bars.

The `perfetto` package's trace processor downloads its binary when first used, which this
machine cannot; set GRAPHRT_TRACE_PROCESSOR to a trace_processor_shell binary to also load the
file with it."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest
from graphrt.profiling.attribution import UNATTRIBUTED, Kernel, Launch, PhaseRange, attribute
from graphrt.profiling.kernel_families import FAMILIES, IDLE, family_bars, kernel_family, write_png
from graphrt.profiling.nsys_sqlite import read_nsys_sqlite
from graphrt.profiling.perfetto_trace import cycle_numbers, trace_events, write_perfetto_trace

DATA = Path(__file__).parent / "data"


def _pdl_attribution():
    """Two cycles at B = 1 and one at B = 8 of a PDL decode; one kernel nobody launched."""
    ranges, launches, kernels = [], [], []
    t, corr = 0, 0
    for b in (1, 1, 8):
        for phase, ks in (("TARGET_VERIFY", [("nvjet_tst_gemm", 100, 0), ("_rms_norm_kernel", 30, 20),
                                             ("_paged_attn_partial_kernel", 40, 5), ("_walk_kernel", 10, -3)]),
                          ("DRAFT_EXTEND", [("_gemv_kernel", 50, 0), ("_argmax_split_kernel", 8, 6)]),
                          ("DRAFT_DECODE", [("_qkv_rotary_kernel", 20, 0), ("_argmax_combine_kernel", 5, 4)])):
            corr += 1
            ranges.append(PhaseRange(phase, b, t, t + 50, "host"))
            launches.append(Launch(corr, t + 10, t + 15, "host", "cudaGraphLaunch"))
            k0 = t + 1000
            for name, dur, lead in ks:  # lead: how long before the previous kernel's end it starts
                start = k0 - lead
                kernels.append(Kernel(corr, start, start + dur, name))
                k0 = start + dur
            t = k0
    kernels.append(Kernel(999, t + 5, t + 9, "stray"))
    return attribute(ranges, launches, kernels, source="synthetic PDL decode")


def check_chrome_trace(events: list[dict]) -> dict[tuple, list[dict]]:
    """The trace-event format as chrome://tracing and Perfetto read it: every event has ph, name,
    pid and tid; complete events ("X") have numeric ts >= 0 and dur >= 0; on one track (pid, tid)
    the slices form a stack: each one either ends before the next starts or holds it whole.
    Returns the slices of each track with their parent ("parent": the enclosing slice or None)."""
    names = {}
    tracks: dict[tuple, list[dict]] = {}
    for e in events:
        for key in ("ph", "name", "pid", "tid"):
            assert key in e, (key, e)
        assert e["ph"] in ("X", "M"), e
        if e["ph"] == "M":
            assert isinstance(e["args"].get("name", e["args"].get("sort_index")), (str, int)), e
            if e["name"] == "thread_name":
                names[(e["pid"], e["tid"])] = e["args"]["name"]
            continue
        assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float)), e
        assert e["ts"] >= 0 and e["dur"] >= 0, e
        tracks.setdefault((e["pid"], e["tid"]), []).append(dict(e))
    for key, slices in tracks.items():
        assert key in names, f"track {key} has no thread_name"
        stack: list[dict] = []
        # ns as integers: ts and dur are ns / 1000 written as floats
        for e in sorted(slices, key=lambda e: (round(e["ts"] * 1e3), -round(e["dur"] * 1e3))):
            start, end = round(e["ts"] * 1e3), round((e["ts"] + e["dur"]) * 1e3)
            # a zero-length slice at its parent's end still belongs to it
            while stack and (stack[-1]["_end"] < start or (stack[-1]["_end"] == start < end)):
                stack.pop()
            if stack:
                assert end <= stack[-1]["_end"], f"{e['name']} crosses {stack[-1]['name']} on {names[key]}"
            e["_end"], e["parent"] = end, stack[-1] if stack else None
            stack.append(e)
    return {names[k]: v for k, v in tracks.items()}


def test_trace_tracks_nesting_waits_and_args(tmp_path):
    r = _pdl_attribution()
    write_perfetto_trace(r, tmp_path / "t.json")
    data = json.loads((tmp_path / "t.json").read_text())
    tracks = check_chrome_trace(data["traceEvents"])
    phase_tracks = [n for n in tracks if n.split(" #")[0] in ("TARGET_VERIFY", "DRAFT_EXTEND", "DRAFT_DECODE")]
    assert {n.split(" #")[0] for n in phase_tracks} == {"TARGET_VERIFY", "DRAFT_EXTEND", "DRAFT_DECODE"}
    assert "TARGET_VERIFY #2" in tracks  # overlapping kernels need a second lane
    kernels = waits = 0
    for name in phase_tracks:
        for e in tracks[name]:
            if e["cat"] == "launch":
                assert e["parent"] is None and e["name"] == name.split(" #")[0]
                assert e["args"]["batch_size"] in (1, 8) and e["args"]["cycle"] in (1, 2, 3)
            elif e["cat"] == "kernel":
                kernels += 1
                assert e["parent"]["cat"] == "launch" and {"exclusive_us", "wait_us", "gap_us", "family"} <= set(
                    e["args"])
            else:
                assert e["cat"] == "wait" and e["parent"]["cat"] == "kernel"
                assert e["parent"]["name"] == e["args"]["kernel"]
                assert e["dur"] == pytest.approx(e["parent"]["args"]["wait_us"])
                assert e["ts"] == e["parent"]["ts"]  # the wait is the start of the kernel
                waits += 1
    assert kernels == sum(len(p.kernels) for p in r.paths) == 24
    assert waits == sum(1 for p in r.paths for k in p.kernels if k.wait_ns) > 0
    assert [e["name"] for e in tracks[UNATTRIBUTED]] == ["stray"]
    write_perfetto_trace(r, tmp_path / "t.json.gz")
    with gzip.open(tmp_path / "t.json.gz", "rt") as f:
        assert json.load(f) == data
    host = tracks["host thread 1"]
    assert len(host) == 9 and all(e["cat"] == "phase" for e in host)
    assert data["traceEvents"][0]["args"]["name"] == "graphrt GPU"


def test_trace_of_the_committed_export():
    fixture = DATA / "nsys_tiny.sqlite"
    if not fixture.exists():
        pytest.skip(f"{fixture} not made yet")
    r = read_nsys_sqlite(fixture)
    tracks = check_chrome_trace(trace_events(r))
    launches = [e for name, t in tracks.items() for e in t if e["cat"] == "launch"]
    assert len(launches) == len(r.paths)
    for e in launches:
        assert e["args"]["batch_size"] in (1, 4)
        assert (e["args"]["cycle"] is None) == (e["name"] == "PREFILL")


def test_trace_loads_in_the_perfetto_trace_processor(tmp_path):
    shell = os.environ.get("GRAPHRT_TRACE_PROCESSOR")
    if not shell:
        pytest.skip("GRAPHRT_TRACE_PROCESSOR (a trace_processor_shell binary) not set")
    from perfetto.trace_processor import TraceProcessor, TraceProcessorConfig

    r = _pdl_attribution()
    write_perfetto_trace(r, tmp_path / "t.json")
    tp = TraceProcessor(trace=str(tmp_path / "t.json"), config=TraceProcessorConfig(bin_path=shell))
    rows = {row.name: row.n for row in tp.query("select name, count(*) as n from slice group by name")}
    assert rows["TARGET_VERIFY"] >= 3 and rows["wait"] > 0
    assert next(iter(tp.query("select count(*) as n from stats where severity = 'error' and value > 0"))).n == 0


def test_cycle_numbers_per_host_thread():
    rs = [PhaseRange("PREFILL", 1, 0, 5, "a"), PhaseRange("TARGET_VERIFY", 1, 10, 20, "a"),
          PhaseRange("DRAFT_EXTEND", 1, 20, 30, "a"), PhaseRange("TARGET_VERIFY", 1, 40, 50, "a"),
          PhaseRange("TARGET_DECODE", 4, 15, 25, "b")]
    assert list(cycle_numbers(rs).values()) == [None, 1, 1, 1, 2]


@pytest.mark.parametrize("name,family", [
    ("_gemv_kernel", "GEMV"), ("_gemv_reduce_kernel", "GEMV"), ("_qkv_rotary_kernel", "GEMV"),
    ("void gemv2T_kernel_val<int, int, __nv_bfloat16, float, 128, 16, 4, 4, false>(Params)", "GEMV"),
    ("nvjet_sm90_tst_8x64_64x16_4x1_v_bz_TNN", "GEMM"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_warpgroupsize1x1x1", "GEMM"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8>(Params)", "GEMM"),
    ("_paged_attn_partial_kernel", "attention"), ("_paged_attn_merge_kernel", "attention"),
    ("_store_kv_kernel", "attention"), ("void flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits>(Params)", "attention"),
    ("_rms_norm_kernel", "norm"), ("void at::native::vectorized_layer_norm_kernel<float, float>(int)", "norm"),
    ("_rotary_store_kv_kernel", "rotary"),
    ("_row_stats_kernel", "sampler"), ("_walk_kernel", "sampler"), ("_race_kernel", "sampler"),
    ("_finish_kernel", "sampler"), ("_simulate_kernel", "sampler"),
    ("void (anonymous namespace)::softmax_warp_forward<float, float, float, 10, false>(float*, float const*)",
     "sampler"),
    ("_argmax_split_kernel", "argmax"), ("_argmax_combine_kernel", "argmax"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<c10::BFloat16, at::native::ArgMaxOps<"
     "c10::BFloat16>, unsigned int, long, 4> >(at::native::ReduceOp<c10::BFloat16, at::native::ArgMaxOps<"
     "c10::BFloat16>, unsigned int, long, 4>)", "argmax"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, "
     "at::native::sum_functor<float, float, float>::operator()>, unsigned int, float, 4> >(int)", "other"),
    ("_silu_and_mul_kernel", "other"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<long>, std::array<char*, 1ul> >"
     "(int, at::native::FillFunctor<long>, std::array<char*, 1ul>)", "other"),
    ("void at::native::normal_kernel<float>(at::TensorIteratorBase&)", "other"),  # not a norm
    ("cuda_graph_replay", "other"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "comm"), ("ncclDevKernel_AllGather_RING_LL", "comm"),
    ("void c10d::symmetric_memory::one_shot_all_reduce_kernel<c10::BFloat16, 16, 2>(c10::BFloat16**, "
     "c10::BFloat16*, c10::BFloat16*, unsigned long, unsigned long, unsigned int**, unsigned long, unsigned long)",
     "comm"),
    ("_assemble_kernel", "sampler"), ("_argmax_finish_kernel", "argmax"),
    ("_cycle_inputs_kernel", "bookkeeping"), ("_advance_kernel", "bookkeeping"),
])
def test_kernel_family(name, family):
    assert kernel_family(name) == family


def test_family_bars_stack_to_the_wall(tmp_path):
    r = _pdl_attribution()
    bars, by_family = family_bars(r)
    assert bars == [("TARGET_VERIFY", 1), ("TARGET_VERIFY", 8), ("DRAFT_EXTEND", 1), ("DRAFT_EXTEND", 8),
                    ("DRAFT_DECODE", 1), ("DRAFT_DECODE", 8)]
    assert list(by_family) == [*FAMILIES, IDLE]
    for i, cell in enumerate(bars):
        stacked = sum(vals[i] for vals in by_family.values())
        assert stacked == pytest.approx(r.by_batch[cell].mean_wall_ns_per_launch / 1e3)
    tv1 = bars.index(("TARGET_VERIFY", 1))
    # TARGET_VERIFY: GEMM 100 ns, the norm waits 20 of its 30 ns, attention 40 - 5, the sampler's
    # kernel starts 3 ns after the attention ends
    assert [by_family[f][tv1] * 1e3 for f in ("GEMM", "norm", "attention", "sampler", IDLE)] == pytest.approx(
        [100, 10, 35, 10, 3])
    fixture = DATA / "nsys_tiny.sqlite"
    if fixture.exists():  # eager PREFILL, mostly host gaps, stays out of the chart
        bars, _ = family_bars(read_nsys_sqlite(fixture))
        assert bars and all(phase != "PREFILL" for phase, _ in bars)
    pytest.importorskip("matplotlib")
    write_png(r, tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
