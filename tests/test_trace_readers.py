"""The trace readers: the Nsight Systems SQLite reader (hand-built exports, and
tests/data/nsys_tiny.sqlite, a real export made on the GPU machine by scripts/make_nsys_fixture.py),
the Kineto Chrome trace parser, and both paths on one PDL timeline. All on the CPU."""

from __future__ import annotations

import json
import re
from decimal import Decimal
from pathlib import Path

import pytest
from graphrt.profiling import nvtx_ranges, report
from graphrt.profiling.attribution import UNATTRIBUTED
from graphrt.profiling.nsys_sqlite import NsysCaptureError, read_nsys_sqlite
from graphrt.profiling.torch_profile import attribute_chrome_trace, load_chrome_trace, records_from_chrome_trace

from tests.profiling_fakes import FakeExport, _standard_capture, _whole_graph_export

DATA = Path(__file__).parent / "data"


# ---- Nsight Systems SQLite export ---------------------------------------------------------------

@pytest.mark.parametrize("registered", [True, False], ids=["textId", "text"])
def test_sqlite_reader_registered_and_inline_text(tmp_path, registered):
    fx = FakeExport(tmp_path / "a.sqlite", registered=registered)
    _standard_capture(fx)
    r = read_nsys_sqlite(fx.close())
    got = {p.name: (p.launches, p.kernels, p.total_ns) for p in r.rows()}
    assert got == {"TARGET_VERIFY": (1, 3, 60), "DRAFT_DECODE": (1, 1, 7), UNATTRIBUTED: (0, 1, 11)}
    assert r.total_ns == 78
    assert set(r.by_batch) == {("TARGET_VERIFY", 8), ("DRAFT_DECODE", 8)}
    assert [k.name for k in r.phases["TARGET_VERIFY"].top_kernels()] == ["verify_k2", "verify_k1", "verify_k0"]


def test_sqlite_reader_event_types_from_enum_table(tmp_path):
    fx = FakeExport(tmp_path / "a.sqlite", enum_offset=1000)  # ids resolved by name, not hard-coded
    _standard_capture(fx)
    r = read_nsys_sqlite(fx.close())
    assert r.phases["TARGET_VERIFY"].total_ns == 60 and r.phases["DRAFT_DECODE"].total_ns == 7


def test_sqlite_reader_two_processes_same_correlation_ids(tmp_path):
    fx = FakeExport(tmp_path / "a.sqlite")
    _standard_capture(fx, pid=1)
    _standard_capture(fx, pid=2, t0=100_000)  # correlation ids 1..4 again, in another process
    r = read_nsys_sqlite(fx.close())
    assert r.phases["TARGET_VERIFY"].launches == 2 and r.phases["TARGET_VERIFY"].total_ns == 120
    assert r.unattributed.total_ns == 22
    assert any("2 processes" in n for n in r.notes)


def test_sqlite_reader_domain_filter(tmp_path):
    fx = FakeExport(tmp_path / "a.sqlite")
    _standard_capture(fx)
    path = fx.close()
    r = read_nsys_sqlite(path, domain=None)  # every domain: the "other" range now counts
    assert r.phases["TARGET_VERIFY"].launches == 2
    with pytest.raises(NsysCaptureError, match=r"no NVTX domain 'nope'.*graphrt.*other.*GRAPHRT_NVTX=1"):
        read_nsys_sqlite(path, domain="nope")


@pytest.mark.parametrize("missing,match", [
    ("nvtx", r"no NVTX_EVENTS table.*-t cuda,nvtx"),
    ("runtime", r"no CUPTI_ACTIVITY_KIND_RUNTIME.*-t cuda,nvtx"),
    ("kernel_table", r"no CUPTI_ACTIVITY_KIND_KERNEL.*nsys profile -t cuda,nvtx --cuda-graph-trace=node"),
])
def test_sqlite_reader_missing_tables(tmp_path, missing, match):
    fx = FakeExport(tmp_path / "a.sqlite", **{missing: False})
    if missing != "nvtx":
        fx.domain("graphrt", 5)
        fx.range("TARGET_VERIFY", 8, 100, 200, 5)
    if missing != "runtime":
        fx.launch(1, 110)
    with pytest.raises(NsysCaptureError, match=match):
        read_nsys_sqlite(fx.close())


def test_sqlite_reader_graph_level_capture_gets_a_clear_message(tmp_path):
    """--cuda-graph-trace=graph (nsys's default): replays are GRAPH_TRACE rows, no kernel rows."""
    with pytest.raises(NsysCaptureError, match=r"whole graphs \(1 rows in CUPTI_ACTIVITY_KIND_GRAPH_TRACE.*"
                                               r"--cuda-graph-trace=node"):
        read_nsys_sqlite(_whole_graph_export(tmp_path / "a.sqlite"))


def test_sqlite_reader_graph_level_capture_without_kernel_table(tmp_path):
    fx = FakeExport(tmp_path / "a.sqlite", kernel_table=False)
    fx.domain("graphrt", 5)
    fx.range("TARGET_VERIFY", 8, 100, 200, 5)
    fx.launch(1, 110, "cudaGraphLaunch_v10000")
    fx.graph_trace(1, 1000, 60)
    with pytest.raises(NsysCaptureError, match="--cuda-graph-trace=node"):
        read_nsys_sqlite(fx.close())


def test_sqlite_reader_graph_launches_without_kernels(tmp_path):
    """No GRAPH_TRACE table either (graph tracing off): every graph launch lacks kernels -> error."""
    fx = FakeExport(tmp_path / "a.sqlite")
    fx.domain("graphrt", 5)
    fx.range("TARGET_VERIFY", 8, 100, 200, 5)
    fx.launch(1, 110, "cudaGraphLaunch_v10000")
    fx.launch(2, 120)
    fx.kernel(2, 2000, 7, "eager")
    with pytest.raises(NsysCaptureError, match="none of the 1 graph launches has a kernel row"):
        read_nsys_sqlite(fx.close())


def test_sqlite_reader_not_sqlite_and_missing_file(tmp_path):
    bad = tmp_path / "bad.sqlite"
    bad.write_bytes(b"this is not a database" * 100)
    with pytest.raises(NsysCaptureError, match="not an SQLite file"):
        read_nsys_sqlite(bad)
    with pytest.raises(FileNotFoundError):
        read_nsys_sqlite(tmp_path / "absent.sqlite")


FIXTURE = DATA / "nsys_tiny.sqlite"


def _project(got, like):
    """got restricted to the keys `like` has; rows (kernels by name, cells by phase and batch size)
    matched by key, whatever their order."""
    if isinstance(like, dict):
        return {k: _project(got[k], v) for k, v in like.items()}
    if isinstance(like, list) and like and isinstance(like[0], dict):
        key = (lambda d: d["name"]) if "name" in like[0] else (lambda d: (d["phase"], d["batch_size"]))
        by_key = {key(d): d for d in got}
        return [_project(by_key[key(d)], d) for d in like]
    return got


def test_sqlite_reader_on_committed_real_export():
    if not FIXTURE.exists():
        pytest.skip(f"{FIXTURE} not made yet: run scripts/make_nsys_fixture.py on the GPU machine")
    expected = json.loads((DATA / "nsys_tiny.expected.json").read_text())
    r = read_nsys_sqlite(FIXTURE)
    got = report.to_json(r, top=None)
    # the shrunk file reads exactly as the full export did, on every figure the expected file
    # holds (it predates wall and exclusive times, which tests/test_critical_path.py checks)
    assert _project(got, expected["attribution"]) == expected["attribution"]
    assert sum(p.total_ns for p in r.phases.values()) + r.unattributed.total_ns == r.total_ns
    for p in r.phases.values():
        assert p.kernels > 0, p.name
    nodes = expected["meta"].get("graph_kernel_nodes", {})
    for key, n in nodes.items():
        phase, b = key.rsplit("/", 1)
        cell = r.by_batch.get((phase, int(b)))
        if cell is not None:
            assert cell.kernels == n * cell.launches, (key, cell.kernels, cell.launches, n)


# ---- Kineto Chrome trace --------------------------------------------------------------------------

BASE_US = 1740461679470813  # absolute epoch microseconds: floats would lose the ns digits


def _us(offset: str) -> Decimal:
    return Decimal(BASE_US) + Decimal(offset)


def _kineto_json(events) -> str:
    """JSON as Kineto writes it: ts/dur as plain decimal numbers with ns digits."""
    text = json.dumps({"schemaVersion": 1, "traceEvents": events}, default=str)
    return re.sub(r'"(ts|dur)": "([0-9.]+)"', r'"\1": \2', text)


def _trace_events():
    pid, tid = 4242, 4243
    ev = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": pid, "tid": tid, "ts": _us("0"),
         "dur": 10_000},
        {"ph": "X", "cat": "user_annotation", "name": "graphrt/TARGET_VERIFY/8", "pid": pid, "tid": tid,
         "ts": _us("10.001"), "dur": 20},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "pid": pid, "tid": tid, "ts": _us("12.5"),
         "dur": 4, "args": {"correlation": 5, "External id": 1}},
        {"ph": "X", "cat": "user_annotation", "name": "graphrt/DRAFT_EXTEND/8", "pid": pid, "tid": tid,
         "ts": _us("40"), "dur": 20},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": pid, "tid": tid, "ts": _us("41"),
         "dur": 5, "args": {"correlation": 6}},
        {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernel", "pid": pid, "tid": tid, "ts": _us("42"),
         "dur": 2, "args": {"correlation": 6}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": pid, "tid": tid, "ts": _us("100"),
         "dur": 5, "args": {"correlation": 7}},  # outside the phase ranges
        {"ph": "X", "cat": "gpu_user_annotation", "name": "graphrt/TARGET_VERIFY/8", "pid": 0, "tid": 7,
         "ts": _us("200"), "dur": 50},
        {"ph": "f", "cat": "ac2g", "name": "ac2g", "id": 5, "pid": 0, "tid": 7, "ts": _us("200")},
        {"ph": "X", "cat": "kernel", "name": "k_a", "pid": 0, "tid": 7, "ts": _us("200.001"), "dur": Decimal("1.234"),
         "args": {"correlation": 5, "stream": 7, "device": 0}},
        {"ph": "X", "cat": "kernel", "name": "k_b", "pid": 0, "tid": 7, "ts": _us("202"), "dur": 2.5,
         "args": {"correlation": 5}},
        {"ph": "X", "cat": "kernel", "name": "k_b", "pid": 0, "tid": 7, "ts": _us("205"), "dur": 2.5,
         "args": {"correlation": 5}},
        {"ph": "X", "cat": "kernel", "name": "k_c", "pid": 0, "tid": 7, "ts": _us("300"), "dur": Decimal("3.001"),
         "args": {"correlation": 6}},
        {"ph": "X", "cat": "kernel", "name": "k_d", "pid": 0, "tid": 7, "ts": _us("400"), "dur": Decimal("0.999"),
         "args": {"correlation": 7}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "pid": 0, "tid": 7, "ts": _us("500"), "dur": 9,
         "args": {"correlation": 8}},
    ]
    return ev


def test_chrome_trace_parser(tmp_path):
    path = tmp_path / "trace.json"
    # written as Kineto writes it: ts/dur as decimal text
    path.write_text(_kineto_json(_trace_events()))
    ranges, launches, kernels = records_from_chrome_trace(load_chrome_trace(path))
    assert [(r.name, r.batch_size) for r in ranges] == [("TARGET_VERIFY", 8), ("DRAFT_EXTEND", 8)]
    assert ranges[0].start_ns == BASE_US * 1000 + 10_001  # exact ns from an absolute timestamp
    assert [ln.name for ln in launches] == ["cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernel",
                                            "cudaLaunchKernel"]
    assert [k.duration_ns for k in kernels] == [1234, 2500, 2500, 3001, 999]
    r = attribute_chrome_trace(path)
    got = {p.name: (p.launches, p.kernels, p.total_ns) for p in r.rows()}
    assert got == {"TARGET_VERIFY": (1, 3, 6234), "DRAFT_EXTEND": (1, 1, 3001), UNATTRIBUTED: (0, 1, 999)}
    assert r.total_ns == 6234 + 3001 + 999


def test_chrome_trace_without_phase_ranges(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(_kineto_json([e for e in _trace_events() if not e["name"].startswith("graphrt/")]))
    with pytest.raises(ValueError, match="no graphrt phase ranges"):
        attribute_chrome_trace(path)


# One decode under PDL, in ns: (phase, B, range start, range end, launches), a launch being
# (correlation id, API call, start, kernels), a kernel (start, duration, name). Graph kernels start
# before their predecessor ends (waits); PREFILL's eager launches leave gaps.
PDL_TIMELINE = [
    ("PREFILL", 1, 0, 900, [(1, "cudaLaunchKernel", 10, [(1000, 50, "gemm")]),
                            (2, "cudaLaunchKernel", 20, [(1060, 5, "_rms_norm_kernel")])]),
    ("TARGET_VERIFY", 1, 1000, 1100, [(3, "cudaGraphLaunch", 1010, [
        (2000, 100, "nvjet_sm90_tst_8x64_64x16_4x1_v_bz_TNN"), (2080, 30, "_rms_norm_kernel"),
        (2105, 40, "_paged_attn_partial_kernel"), (2150, 10, "_walk_kernel")])]),
    ("DRAFT_DECODE", 1, 1200, 1300, [(4, "cudaGraphLaunch", 1210, [
        (2300, 20, "_argmax_split_kernel"), (2310, 15, "_argmax_combine_kernel")])]),
    ("TARGET_VERIFY", 1, 1400, 1500, [(5, "cudaGraphLaunch", 1410, [
        (2400, 90, "nvjet_sm90_tst_8x64_64x16_4x1_v_bz_TNN"), (2470, 40, "_rms_norm_kernel"),
        (2500, 35, "_paged_attn_partial_kernel"), (2536, 10, "_walk_kernel")])]),
]


def _timeline_as_nsys_export(path):
    fx = FakeExport(path)
    fx.domain("graphrt", 5)
    for phase, b, r0, r1, launches in PDL_TIMELINE:
        fx.range(phase, b, r0, r1, 5)
        for corr, api, t, kernels in launches:
            fx.launch(corr, t, api)
            for k0, dur, name in kernels:
                fx.kernel(corr, k0, dur, name)
    return fx.close()


def _timeline_as_kineto_trace(path):
    def us(ns):  # Kineto's absolute microseconds with the ns digits
        return _us(f"{ns // 1000}.{ns % 1000:03d}")

    pid, tid = 77, 78
    ev = []
    for phase, b, r0, r1, launches in PDL_TIMELINE:
        ev.append({"ph": "X", "cat": "user_annotation", "name": f"graphrt/{phase}/{b}", "pid": pid, "tid": tid,
                   "ts": us(r0), "dur": Decimal(r1 - r0) / 1000})
        for corr, api, t, kernels in launches:
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": api, "pid": pid, "tid": tid, "ts": us(t),
                       "dur": Decimal(5) / 1000, "args": {"correlation": corr}})
            for k0, dur, name in kernels:
                ev.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": us(k0),
                           "dur": Decimal(dur) / 1000, "args": {"correlation": corr}})
    path.write_text(_kineto_json(ev))
    return path


def _critical_figures(r):
    cells = {key: (c.launches, c.kernels, c.wall_ns, c.total_ns,
                   sorted((k.name, k.count, k.exclusive_ns, k.wait_ns, k.gap_ns) for k in c.kernels_by_name.values()))
             for key, c in r.by_batch.items()}
    paths = [[(k.name, k.duration_ns, k.exclusive_ns, k.wait_ns, k.gap_ns) for k in p.kernels] for p in r.paths]
    return cells, paths


def test_nsys_and_profiler_paths_agree_on_one_timeline(tmp_path):
    """The same decode read from an Nsight export and from a Kineto trace gives the same wall,
    exclusive, wait and gap figures, to the ns (one function computes them for both)."""
    nsys = read_nsys_sqlite(_timeline_as_nsys_export(tmp_path / "t.sqlite"))
    torch_r = attribute_chrome_trace(_timeline_as_kineto_trace(tmp_path / "t.json"))
    assert _critical_figures(nsys) == _critical_figures(torch_r)
    tv = nsys.by_batch[("TARGET_VERIFY", 1)]
    # launch 1: 2000..2160, launch 2: 2400..2546; durations sum to 355 ns, the walls to 306 ns
    assert (tv.wall_ns, tv.total_ns) == (160 + 146, 180 + 175)
    norm = tv.kernels_by_name["_rms_norm_kernel"]
    assert (norm.wait_ns, norm.exclusive_ns) == (20 + 20, 10 + 20)  # it mostly waits for the GEMM
    assert [k.name for k in tv.top_kernels(1)] == ["nvjet_sm90_tst_8x64_64x16_4x1_v_bz_TNN"]
    assert nsys.by_batch[("PREFILL", 1)].kernels_by_name["_rms_norm_kernel"].gap_ns == 10


def test_torch_ranges_reach_the_kineto_trace_on_cpu(tmp_path):
    """PhaseHooks opens record_function ranges while torch_ranges() is on; a CPU-only profile
    then holds them as user annotations that the parser turns into phase ranges."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    hooks = nvtx_ranges.PhaseHooks()
    with nvtx_ranges.torch_ranges(), profile(activities=[ProfilerActivity.CPU]) as prof:
        with hooks.phase("TARGET_VERIFY", 8):
            torch.ones(4).sum()
        with hooks.phase("DRAFT_DECODE", 2):
            torch.ones(4).sum()
    assert not nvtx_ranges._STATE.torch
    path = tmp_path / "kineto.json"
    prof.export_chrome_trace(str(path))
    ranges, _, kernels = records_from_chrome_trace(load_chrome_trace(path))
    assert [(r.name, r.batch_size) for r in ranges] == [("TARGET_VERIFY", 8), ("DRAFT_DECODE", 2)]
    assert kernels == []
