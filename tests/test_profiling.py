"""Profiling: attribution, the Nsight SQLite reader, the Kineto trace parser, NVTX hooks, reports.

Everything runs on the CPU except the tests marked gpu. The SQLite files are built here with the
column names of Nsight Systems' export schema; tests/data/nsys_tiny.sqlite (made on the GPU machine
by scripts/make_nsys_fixture.py) is a real export.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import re
import shutil
import sqlite3
from decimal import Decimal
from pathlib import Path

import pytest
from graphrt.profiling import nvtx_ranges, report
from graphrt.profiling.attribution import UNATTRIBUTED, Kernel, Launch, PhaseRange, attribute, short_kernel_name
from graphrt.profiling.nsys_sqlite import NsysCaptureError, read_nsys_sqlite
from graphrt.profiling.torch_profile import attribute_chrome_trace, load_chrome_trace, records_from_chrome_trace
from graphrt.profiling.workload import Workload, keyed_from_json

DATA = Path(__file__).parent / "data"

# ---- attribution on hand-made records ----------------------------------------------------------


def _hand_made():
    T1, T2 = "thread-1", "thread-2"
    ranges = [
        PhaseRange("TARGET_VERIFY", 8, 100, 200, T1),
        PhaseRange("DRAFT_EXTEND", 8, 300, 400, T1),
        PhaseRange("PREFILL", 1, 1000, 2000, T1),
        PhaseRange("DRAFT_DECODE", 1, 1200, 1300, T1),  # nested in PREFILL: innermost wins
        PhaseRange("TARGET_VERIFY", 4, 150, 250, T2),  # overlaps thread 1's ranges in time
    ]
    launches = [
        Launch(1, 110, 120, T1, "cudaGraphLaunch"),
        Launch(2, 310, 315, T1, "cudaLaunchKernel"),
        Launch(3, 320, 325, T1, "cudaLaunchKernel"),
        Launch(3, 321, 324, T1, "cuLaunchKernel"),  # the driver call inside it: same correlation id
        Launch(4, 500, 505, T1, "cudaLaunchKernel"),  # outside every range
        Launch(5, 1100, 1105, T1, "cudaLaunchKernel"),  # PREFILL
        Launch(6, 1250, 1255, T1, "cudaGraphLaunch"),  # DRAFT_DECODE
        Launch(7, 1400, 1405, T1, "cudaLaunchKernel"),  # PREFILL, after the nested range closed
        Launch(8, 210, 215, T2, "cudaGraphLaunch"),  # thread 2's TARGET_VERIFY B=4
        Launch(9, 210, 215, T1, "cudaLaunchKernel"),  # same time on thread 1: outside its ranges
    ]
    gemm = "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8>(Params)"
    kernels = [
        # graph replay: five kernels share the cudaGraphLaunch's correlation id
        Kernel(1, 1000, 1010, gemm),
        Kernel(1, 1010, 1030, "_paged_attention_kernel"),
        Kernel(1, 1030, 1060, gemm),
        Kernel(1, 1060, 1100, "_rejection_kernel"),
        Kernel(1, 1100, 1150, "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<long>, "
                              "std::array<char*, 1ul> >(int, at::native::FillFunctor<long>, std::array<char*, 1ul>)"),
        Kernel(2, 2000, 2007, "argmax_kernel"),
        Kernel(3, 2010, 2015, "argmax_kernel"),
        Kernel(4, 2100, 2111, "stray_kernel"),
        Kernel(99, 2200, 2213, "orphan_kernel"),  # no launch record at all
        Kernel(5, 3000, 3100, "prefill_gemm"),
        Kernel(6, 3200, 3203, "decode_a"),
        Kernel(6, 3203, 3207, "decode_b"),
        Kernel(7, 3300, 3302, "prefill_tail"),
        Kernel(8, 3400, 3417, "verify_b4"),
        Kernel(9, 3500, 3519, "thread1_stray"),
    ]
    return ranges, launches, kernels


def test_attribution_exact_table():
    r = attribute(*_hand_made())
    got = {p.name: (p.launches, p.kernels, p.total_ns) for p in r.rows()}
    assert got == {
        "TARGET_VERIFY": (2, 6, 150 + 17),
        "DRAFT_EXTEND": (1, 2, 12),
        "PREFILL": (1, 2, 102),
        "DRAFT_DECODE": (1, 2, 7),
        UNATTRIBUTED: (0, 3, 11 + 13 + 19),
    }
    assert r.total_kernels == 15
    assert r.total_ns == 150 + 17 + 12 + 102 + 7 + 43
    # conservation, exact in integer ns
    assert sum(p.total_ns for p in r.phases.values()) + r.unattributed.total_ns == r.total_ns
    assert r.reasons == {"launch outside every phase range": 2, "no launch record with its correlation id": 1}
    cells = {k: (c.launches, c.kernels, c.total_ns) for k, c in r.by_batch.items()}
    assert cells == {("TARGET_VERIFY", 8): (1, 5, 150), ("TARGET_VERIFY", 4): (1, 1, 17),
                     ("DRAFT_EXTEND", 8): (1, 2, 12), ("PREFILL", 1): (1, 2, 102), ("DRAFT_DECODE", 1): (1, 2, 7)}
    tv8 = r.by_batch[("TARGET_VERIFY", 8)]
    assert tv8.kernels_per_launch == 5 and tv8.mean_ns_per_launch == 150
    top = [(k.name, k.count, k.total_ns) for k in tv8.top_kernels()]
    assert top == [("vectorized_elementwise_kernel", 1, 50), ("Kernel2", 2, 40), ("_rejection_kernel", 1, 40),
                   ("_paged_attention_kernel", 1, 20)]
    assert r.share(r.phases["TARGET_VERIFY"]) == pytest.approx(167 / r.total_ns)
    # every kernel is assigned to its range object (the trace export relies on it)
    owner = {k.correlation_id: (rg.name if rg else None) for k, rg in r.assignment}
    assert owner == {1: "TARGET_VERIFY", 2: "DRAFT_EXTEND", 3: "DRAFT_EXTEND", 4: None, 99: None, 5: "PREFILL",
                     6: "DRAFT_DECODE", 7: "PREFILL", 8: "TARGET_VERIFY", 9: None}


def _brute_owner(ranges, launch):
    inside = [r for r in ranges if r.tid == launch.tid and r.start_ns <= launch.start_ns <= r.end_ns]
    if not inside:
        return None
    return max(inside, key=lambda r: (r.start_ns, -(r.end_ns - r.start_ns)))


@pytest.mark.parametrize("seed", range(20))
def test_attribution_random_matches_brute_force_and_conserves(seed):
    rng = random.Random(seed)
    ranges = []
    for tid in (0, 1):
        t = 0
        for _ in range(rng.randint(0, 12)):  # properly nested push/pop ranges, as NVTX makes them
            t += rng.randint(0, 30)
            outer = PhaseRange(rng.choice(["A", "B", "C"]), rng.choice([1, 8]), t, t + rng.randint(0, 100), tid)
            ranges.append(outer)
            if rng.random() < 0.4 and outer.end_ns - outer.start_ns > 2:
                s = rng.randint(outer.start_ns, outer.end_ns - 1)
                ranges.append(PhaseRange("N", 1, s, rng.randint(s, outer.end_ns), tid))
            t = outer.end_ns
    launches, kernels = [], []
    for c in range(rng.randint(0, 80)):
        s = rng.randint(0, 800)
        launches.append(Launch(c, s, s + 3, rng.choice((0, 1))))
        for _ in range(rng.randint(0, 4)):
            ks = rng.randint(0, 5000)
            kernels.append(Kernel(c if rng.random() < 0.9 else 10_000 + c, ks, ks + rng.randint(0, 50), f"k{c % 5}"))
    r = attribute(ranges, launches, kernels)
    assert sum(p.total_ns for p in r.phases.values()) + r.unattributed.total_ns == r.total_ns
    assert r.total_ns == sum(k.duration_ns for k in kernels)
    by_corr = {ln.correlation_id: ln for ln in launches}
    for k, got in r.assignment:
        ln = by_corr.get(k.correlation_id)
        want = _brute_owner(ranges, ln) if ln is not None else None
        assert (got.name, got.start_ns, got.end_ns) == (want.name, want.start_ns, want.end_ns) if want else got is None


def test_attribution_empty_and_bad_input():
    r = attribute([], [], [])
    assert r.total_ns == 0 and r.rows()[-1].name == UNATTRIBUTED and r.unattributed.kernels == 0
    with pytest.raises(ValueError, match="ends before it starts"):
        attribute([PhaseRange("A", 1, 10, 5, 0)], [], [])


@pytest.mark.parametrize("name,short", [
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<long>, std::array<char*, 1ul> >"
     "(int, at::native::FillFunctor<long>, std::array<char*, 1ul>)", "vectorized_elementwise_kernel"),
    ("void (anonymous namespace)::softmax_warp_forward<float, float, float, 10, false>(float*, float const*)",
     "softmax_warp_forward"),
    ("_argmax_kernel", "_argmax_kernel"),
    ("nvjet_tst_128x64_64x8_1x1_v_bz_coopB_TNT", "nvjet_tst_128x64_64x8_1x1_v_bz_coopB_TNT"),
    ("_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIlEEEEviT0_T1_",
     "vectorized_elementwise_kernel"),
    ("_Z16paged_attnKernelPfS_", "paged_attnKernel"),
    ("x" * 100, "x" * 63 + "…"),
])
def test_short_kernel_name(name, short):
    assert short_kernel_name(name) == short


# ---- Nsight Systems SQLite export ---------------------------------------------------------------

PUSHPOP, STARTEND, DOMAIN_CREATE = 59, 60, 75
NVTX_COLS = ("start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL, rangeId INTEGER, category INTEGER, "
             "color INTEGER, text TEXT, globalTid INTEGER, endGlobalTid INTEGER, textId INTEGER, domainId INTEGER, "
             "uint64Value INTEGER, int64Value INTEGER, doubleValue REAL, uint32Value INTEGER, int32Value INTEGER, "
             "floatValue REAL, jsonTextId INTEGER, jsonText TEXT")


def _gtid(pid, tid):
    return (pid << 24) | tid


class FakeExport:
    """A small SQLite file with Nsight Systems' table and column names."""

    def __init__(self, path, *, registered=True, nvtx=True, runtime=True, kernel_table=True, enum_offset=0):
        self.path = Path(path)
        self.con = sqlite3.connect(self.path)
        self.registered = registered
        self.types = {"NvtxPushPopRange": PUSHPOP + enum_offset, "NvtxStartEndRange": STARTEND + enum_offset,
                      "NvtxDomainCreate": DOMAIN_CREATE + enum_offset}
        c = self.con
        c.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL)")
        if enum_offset:
            c.execute("CREATE TABLE ENUM_NSYS_EVENT_TYPE (id INTEGER PRIMARY KEY, name TEXT, label TEXT)")
            c.executemany("INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES (?, ?, ?)",
                          [(i, n, n) for n, i in self.types.items()] + [(34, "NvtxMark", "mark")])
        if nvtx:
            cols = NVTX_COLS if registered else NVTX_COLS.replace(", textId INTEGER", "")
            c.execute(f"CREATE TABLE NVTX_EVENTS ({cols})")
        if runtime:
            c.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER NOT NULL, end INTEGER NOT NULL, "
                      "eventClass INTEGER NOT NULL, globalTid INTEGER, correlationId INTEGER, nameId INTEGER NOT NULL, "
                      "returnValue INTEGER NOT NULL, callchainId INTEGER)")
        if kernel_table:
            c.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER NOT NULL, end INTEGER NOT NULL, "
                      "deviceId INTEGER NOT NULL, contextId INTEGER NOT NULL, streamId INTEGER NOT NULL, "
                      "correlationId INTEGER, globalPid INTEGER, demangledName INTEGER NOT NULL, "
                      "shortName INTEGER NOT NULL, mangledName INTEGER, launchType INTEGER, gridX INTEGER, "
                      "blockX INTEGER, graphNodeId INTEGER, graphId INTEGER)")
        self._strings: dict[str, int] = {}

    def s(self, text):
        if text not in self._strings:
            self._strings[text] = len(self._strings) + 1
            self.con.execute("INSERT INTO StringIds VALUES (?, ?)", (self._strings[text], text))
        return self._strings[text]

    def domain(self, name, domain_id, pid=1, tid=1):
        self.con.execute("INSERT INTO NVTX_EVENTS (start, eventType, text, globalTid, domainId) VALUES (?, ?, ?, ?, ?)",
                         (1, self.types["NvtxDomainCreate"], name, _gtid(pid, tid), domain_id))

    def range(self, name, b, start, end, domain_id, pid=1, tid=1, kind="NvtxPushPopRange"):
        et = self.types[kind]
        if self.registered:
            self.con.execute("INSERT INTO NVTX_EVENTS (start, end, eventType, globalTid, textId, domainId, int64Value) "
                             "VALUES (?, ?, ?, ?, ?, ?, ?)",
                             (start, end, et, _gtid(pid, tid), self.s(name), domain_id, b))
        else:
            self.con.execute("INSERT INTO NVTX_EVENTS (start, end, eventType, globalTid, text, domainId, int64Value) "
                             "VALUES (?, ?, ?, ?, ?, ?, ?)", (start, end, et, _gtid(pid, tid), name, domain_id, b))

    def launch(self, corr, start, name="cudaLaunchKernel_v7000", pid=1, tid=1):
        self.con.execute("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, 1, ?, ?, ?, 0, NULL)",
                         (start, start + 5, _gtid(pid, tid), corr, self.s(name)))

    def kernel(self, corr, start, dur, name, pid=1, node=None):
        self.con.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL (start, end, deviceId, contextId, streamId, "
                         "correlationId, globalPid, demangledName, shortName, graphNodeId) "
                         "VALUES (?, ?, 0, 1, 7, ?, ?, ?, ?, ?)",
                         (start, start + dur, corr, _gtid(pid, 0), self.s(name), self.s(short_kernel_name(name)), node))

    def graph_trace(self, corr, start, dur):
        self.con.execute("CREATE TABLE IF NOT EXISTS CUPTI_ACTIVITY_KIND_GRAPH_TRACE (start INTEGER NOT NULL, "
                         "end INTEGER NOT NULL, deviceId INTEGER, contextId INTEGER, streamId INTEGER, "
                         "correlationId INTEGER, globalPid INTEGER, graphId INTEGER, graphExecId INTEGER)")
        self.con.execute("INSERT INTO CUPTI_ACTIVITY_KIND_GRAPH_TRACE VALUES (?, ?, 0, 1, 7, ?, ?, 3, 4)",
                         (start, start + dur, corr, _gtid(1, 0)))

    def close(self):
        self.con.commit()
        self.con.close()
        return self.path


def _standard_capture(fx: FakeExport, *, pid=1, corr0=0, t0=0):
    """graphrt domain 5; another domain 9 whose range covers everything and must be ignored."""
    fx.domain("graphrt", 5, pid=pid)
    fx.domain("other", 9, pid=pid)
    fx.range("TARGET_VERIFY", 999, t0 + 0, t0 + 10_000, 9, pid=pid)  # another domain: ignored
    fx.range("TARGET_VERIFY", 8, t0 + 100, t0 + 200, 5, pid=pid)
    fx.launch(corr0 + 1, t0 + 110, "cudaGraphLaunch_v10000", pid=pid)
    for i, d in enumerate((10, 20, 30)):
        fx.kernel(corr0 + 1, t0 + 1000 + 40 * i, d, f"void ns::verify_k{i}<1>(int)", pid=pid, node=100 + i)
    fx.range("DRAFT_DECODE", 8, t0 + 300, t0 + 400, 5, pid=pid, kind="NvtxStartEndRange")
    fx.launch(corr0 + 2, t0 + 310, "cuLaunchKernel", pid=pid)
    fx.kernel(corr0 + 2, t0 + 2000, 7, "_argmax_kernel", pid=pid)
    fx.launch(corr0 + 3, t0 + 5000, pid=pid)  # outside graphrt ranges (inside "other")
    fx.kernel(corr0 + 3, t0 + 6000, 11, "stray", pid=pid)
    fx.launch(corr0 + 4, t0 + 150, "cudaMemcpyAsync_v3020", pid=pid)  # no kernel: harmless


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


def _whole_graph_export(path):
    """A --cuda-graph-trace=graph capture: one TARGET_VERIFY replay as a GRAPH_TRACE row (60 ns),
    one eager PREFILL kernel (7 ns)."""
    fx = FakeExport(path)
    fx.domain("graphrt", 5)
    fx.range("TARGET_VERIFY", 8, 100, 200, 5)
    fx.launch(1, 110, "cudaGraphLaunch_v10000")
    fx.graph_trace(1, 1000, 60)
    fx.range("PREFILL", 1, 300, 400, 5)  # eager work still has kernel rows
    fx.launch(2, 310)
    fx.kernel(2, 2000, 7, "prefill_gemm")
    return fx.close()


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


# ---- NVTX ranges and PhaseHooks ---------------------------------------------------------------------


@pytest.fixture
def nvtx_state():
    s = nvtx_ranges._STATE
    saved = (s.nvtx, s.torch, s.domain, s.push, s.pop, dict(s.attrs), s.category)
    yield s
    s.nvtx, s.torch, s.domain, s.push, s.pop = saved[:5]
    s.attrs.clear()
    s.attrs.update(saved[5])
    s.category = saved[6]
    nvtx_ranges._refresh()


def test_hooks_off_are_a_shared_null_context(nvtx_state):
    nvtx_ranges.disable_nvtx()
    hooks = nvtx_ranges.PhaseHooks()
    assert hooks.phase("TARGET_VERIFY", 8) is hooks.phase("DRAFT_DECODE", 1) is nvtx_ranges._NULL
    with hooks.phase("TARGET_VERIFY", 8):
        pass


def test_nvtx_without_a_tool_stays_off_and_callable(nvtx_state):
    # on the CPU box no NVTX tool is attached: the nvtx package gives a dummy domain
    assert nvtx_ranges.enable_nvtx(True) is False
    with nvtx_ranges.PhaseHooks().phase("TARGET_VERIFY", 8):
        pass
    assert nvtx_ranges.enable_nvtx(None) is False


def test_nvtx_ranges_push_and_pop_with_cached_attributes(nvtx_state):
    calls = []

    class FakeDomain:
        handle = "H"

        def get_category_id(self, name):
            calls.append(("category", name))
            return 1

        def get_event_attributes(self, message, category, payload):
            calls.append(("attrs", message, category, payload))
            return (message, payload)

    nvtx_state.domain = FakeDomain()
    nvtx_state.push = lambda attrs, handle: calls.append(("push", attrs, handle))
    nvtx_state.pop = lambda handle: calls.append(("pop", handle))
    nvtx_state.attrs.clear()
    nvtx_state.category = None
    assert nvtx_ranges.enable_nvtx(True) is True

    from graphrt.profiling.phase_timer import PhaseTimer

    timer = PhaseTimer("cpu")
    hooks = nvtx_ranges.PhaseHooks(timer=timer)
    for _ in range(2):
        with hooks.phase("TARGET_VERIFY", 8):
            calls.append("work")
    assert calls == [("category", "phase"), ("attrs", "TARGET_VERIFY", 1, 8),
                     ("push", ("TARGET_VERIFY", 8), "H"), "work", ("pop", "H"),
                     ("push", ("TARGET_VERIFY", 8), "H"), "work", ("pop", "H")]  # attributes built once
    assert timer.summary()["TARGET_VERIFY"]["calls"] == 2
    with pytest.raises(KeyError), hooks.phase("DRAFT_DECODE", 1):  # exceptions still pop the range
        raise KeyError("x")
    assert calls[-1] == ("pop", "H")
    nvtx_ranges.disable_nvtx()
    assert hooks.phase("TARGET_VERIFY", 8) is not nvtx_ranges._NULL  # a timer is still there


def test_nvtx_real_extension_push_pop(nvtx_state):
    """The real nvtx C extension path (a Domain object forced on; libnvtx's calls are no-ops here)."""
    nvtx = pytest.importorskip("nvtx")
    d = object.__new__(nvtx._lib.Domain)
    d.handle = nvtx._lib.lib.DomainHandle("graphrt")
    nvtx._lib.Domain.__init__(d, "graphrt")
    nvtx_state.domain, nvtx_state.push, nvtx_state.pop = d, nvtx._lib.push_range, nvtx._lib.pop_range
    nvtx_state.attrs.clear()
    nvtx_state.category = None
    assert nvtx_ranges.enable_nvtx(True)
    hooks = nvtx_ranges.PhaseHooks()
    with hooks.phase("TARGET_VERIFY", 8), hooks.phase("DRAFT_EXTEND", 8):
        pass
    assert set(nvtx_state.attrs) == {("TARGET_VERIFY", 8), ("DRAFT_EXTEND", 8)}


def test_env_switch(monkeypatch):
    for v, want in (("1", True), ("on", True), ("0", False), ("", None), ("maybe", None)):
        monkeypatch.setenv("GRAPHRT_NVTX", v)
        assert nvtx_ranges._env_setting() is want


def test_torch_range_names():
    assert nvtx_ranges.parse_torch_range_name("graphrt/DRAFT_EXTEND/64") == ("DRAFT_EXTEND", 64)
    assert nvtx_ranges.parse_torch_range_name("graphrt/PREFILL") == ("PREFILL", None)
    assert nvtx_ranges.parse_torch_range_name("ProfilerStep#3") is None


# ---- reports and graphrt profile -------------------------------------------------------------------


def test_text_table_and_json():
    r = attribute(*_hand_made(), source="hand-made")
    events = {("TARGET_VERIFY", 8): 0.16, ("DRAFT_EXTEND", 8): 0.01}  # us per launch
    text = report.format_table(r, expected_nodes={("TARGET_VERIFY", 8): 5}, events=events,
                               events_traced={("TARGET_VERIFY", 8): 0.17})
    lines = text.splitlines()
    assert lines[0].startswith("graphrt profile (hand-made): 15 kernels")
    # TARGET_VERIFY B=8: one launch, kernels 1000..1150 ns back to back: wall 150 ns = 0.15 us
    assert "tracing overhead" in lines[1] and "worst DRAFT_EXTEND B=8" in lines[1] and "OVER 5%" in lines[1]
    tv = next(ln for ln in lines if ln.startswith("TARGET_VERIFY ") and ln.split()[1] == "8")
    assert tv.split()[1:] == ["8", "1", "5/5", "0.1", "0.2", "0.2", "-6.2%", "0.1"]
    start = lines.index(next(ln for ln in lines if ln.startswith("by phase")))
    rows = [ln.split()[0] for ln in lines[start + 3:start + 9]]
    assert rows == ["PREFILL", "TARGET_VERIFY", "DRAFT_EXTEND", "DRAFT_DECODE", UNATTRIBUTED, "total"]
    assert "1 no launch record" in text and "TARGET_VERIFY B=8: wall 0.1 us per launch" in text
    assert "vectorized_elementwise_kernel" in text
    # by kernel family: TARGET_VERIFY B=8's GEMM 40 ns, attention 20, the sampler 40, the fill 50
    fam = lines.index(next(ln for ln in lines if ln.startswith("by kernel family")))
    cols = lines[fam + 1].split()
    assert cols[:2] == ["phase", "B"] and "comm" not in cols and "PREFILL" not in text[text.index("by kernel family"):
                                                                                         text.index("top kernels")]
    tvf = next(ln.split() for ln in lines[fam + 3:] if ln.startswith("TARGET_VERIFY ") and ln.split()[1] == "8")
    assert {"GEMM", "attention", "sampler", "other", "idle"} <= set(cols) and len(tvf) == len(cols)
    assert sum(map(float, tvf[2:])) == pytest.approx(0.15, abs=0.3)  # 0.1 us each at most, rounded
    j = report.to_json(r, meta={"x": 1}, events=events)
    assert [p["phase"] for p in j["phases"]] == ["PREFILL", "TARGET_VERIFY", "DRAFT_EXTEND", "DRAFT_DECODE"]
    assert sum(p["total_ns"] for p in j["phases"]) + j["unattributed"]["total_ns"] == j["total_ns"]
    assert j["unattributed"]["kernels_per_launch"] is None and j["unattributed"]["wall_ns"] is None
    assert j["meta"] == {"x": 1}
    cell = next(c for c in j["by_batch"] if (c["phase"], c["batch_size"]) == ("TARGET_VERIFY", 8))
    assert cell["wall_ns"] == 150 and cell["cuda_events_us"] == 0.16
    assert cell["wall_over_events"] == pytest.approx(0.15 / 0.16 - 1)
    assert sum(k["exclusive_ns"] for k in cell["top_kernels"]) == cell["wall_ns"]
    assert cell["families_us"]["GEMM"] == pytest.approx(0.04) and cell["families_us"]["other"] == pytest.approx(0.05)
    assert sum(cell["families_us"].values()) == pytest.approx(cell["wall_ns"] / 1e3)
    assert next(c for c in j["by_batch"] if c["phase"] == "PREFILL")["families_us"] is None
    assert j["tracing_overhead"]["worst"]["phase"] == "DRAFT_EXTEND" and j["tracing_overhead"]["over_limit"]
    assert json.loads(json.dumps(report.to_json(r), allow_nan=False))["total_kernels"] == 15  # strict JSON (no NaN)


def test_tracing_overhead_within_limit_and_prefill_left_out():
    r = attribute(*_hand_made())
    # PREFILL's ratio is far off (eager launches pay the tracer per call) and does not count
    t = report.tracing_overhead(r, {("TARGET_VERIFY", 8): 0.149, ("PREFILL", 1): 1.0})
    assert t["worst"]["phase"] == "TARGET_VERIFY" and not t["over_limit"]
    assert "within 5%" in report.format_table(r, events={("TARGET_VERIFY", 8): 0.149})
    assert report.tracing_overhead(r, None) is None


def _profile_args(argv):
    """`graphrt profile ARGV` as the CLI parses it."""
    from graphrt.cli import build_parser

    return build_parser().parse_args(["profile", *argv])


def test_cli_main_from_sqlite(tmp_path, capsys):
    fx = FakeExport(tmp_path / "a.sqlite")
    _standard_capture(fx)
    path = fx.close()
    args = _profile_args(["--from-sqlite", str(path), "--json", str(tmp_path / "o.json"),
                                         "--trace", str(tmp_path / "t.json")])
    assert report.cli_main(args) == 0
    out = capsys.readouterr().out
    assert "TARGET_VERIFY" in out and "unattributed" in out
    assert json.loads((tmp_path / "o.json").read_text())["total_ns"] == 78
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]


def test_cli_graph_trace_reads_whole_graph_captures(tmp_path, capsys):
    """--graph-trace: each replay is one record; its span is the phase's wall time."""
    path = _whole_graph_export(tmp_path / "a.sqlite")
    r = read_nsys_sqlite(path, graph_trace=True)
    assert r.by_batch[("TARGET_VERIFY", 8)].wall_ns == 60 and r.by_batch[("PREFILL", 1)].wall_ns == 7
    assert any("--cuda-graph-trace=graph" in n for n in r.notes)
    assert report.cli_main(_profile_args(["--from-sqlite", str(path), "--graph-trace"])) == 0
    assert "cuda_graph_replay" in capsys.readouterr().out
    fx = FakeExport(tmp_path / "b.sqlite")
    _standard_capture(fx)
    with pytest.raises(NsysCaptureError, match="without --graph-trace"):
        read_nsys_sqlite(fx.close(), graph_trace=True)


def test_cli_main_errors_are_graphrt_errors(tmp_path, monkeypatch):
    from graphrt.errors import GraphrtError

    fx = FakeExport(tmp_path / "a.sqlite", nvtx=False)
    path = fx.close()
    with pytest.raises(GraphrtError, match="no NVTX_EVENTS"):
        report.cli_main(_profile_args(["--from-sqlite", str(path)]))
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(GraphrtError, match="nsys .* is not on PATH"):
        report.cli_main(_profile_args(["--nsys"]))
    with pytest.raises(GraphrtError, match="needs a CUDA device.*--from-sqlite"):  # before building anything
        report.cli_main(_profile_args(["--device", "cpu"]))
    with pytest.raises(GraphrtError, match="--graph-trace is an nsys capture mode"):
        report.cli_main(_profile_args(["--graph-trace"]))


def test_nsys_inner_command_reproduces_the_workload():
    from graphrt.profiling.nsys_run import inner_command

    args = _profile_args(["ckpt", "--batch-sizes", "1,8", "--max-new-tokens", "5", "--eager", "--dtype", "bf16",
                          "--draft-kind", "eagle3", "--draft-quantization", "fp8"])
    cmd = inner_command(args, Path("/tmp/m.json"))
    assert cmd[1:5] == ["-m", "graphrt", "profile", "ckpt"]
    assert cmd[cmd.index("--batch-sizes") + 1] == "1,8" and "--eager" in cmd and cmd[-3:] == [
        "--_inner", "--_meta", "/tmp/m.json"]
    # the inner command parses back to the same workload
    back = _profile_args(cmd[4:])
    workload = ("checkpoint", "batch_sizes", "max_new_tokens", "prompt_len", "eager", "no_draft", "dtype", "device",
                "draft", "draft_kind", "draft_quantization", "draft_layers", "num_draft_tokens", "preset")
    assert [getattr(back, a) for a in workload] == [getattr(args, a) for a in workload] and back._inner


def test_png_without_matplotlib(monkeypatch, tmp_path):
    import builtins

    real = builtins.__import__

    def fake(name, *a, **kw):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", fake)
    from graphrt.profiling.kernel_families import write_png

    with pytest.raises(RuntimeError, match="pip install matplotlib"):
        write_png(attribute(*_hand_made()), tmp_path / "c.png")


def _cpu_workload_args(tmp_path, monkeypatch, *extra):
    monkeypatch.setenv("GRAPHRT_CACHE", str(tmp_path / "cache"))
    return _profile_args(["--preset", "tiny", "--batch-sizes", "1,2", "--max-new-tokens", "4",
                                         "--prompt-len", "8", "--device", "cpu", *extra])


def test_inner_run_on_cpu_writes_meta(tmp_path, monkeypatch, nvtx_state):
    """The command nsys runs (`graphrt profile --_inner`) works end to end on the CPU."""
    args = _cpu_workload_args(tmp_path, monkeypatch, "--_inner", "--_meta", str(tmp_path / "m.json"))
    assert report.cli_main(args) == 0
    meta = json.loads((tmp_path / "m.json").read_text())
    assert meta["batch_sizes"] == [1, 2] and meta["device"] == "cpu" and meta["graph_kernel_nodes"] == {}
    # the measured decode's phase times (on the CPU a wall clock), keyed as the profile's cells
    assert {"TARGET_VERIFY/1", "TARGET_VERIFY/2", "DRAFT_DECODE/2", "PREFILL/1"} <= set(meta["cuda_events_traced_us"])
    assert all(v > 0 for v in meta["cuda_events_traced_us"].values())
    assert not nvtx_ranges._STATE.nvtx


def test_cycle_phases_sit_in_ranges_on_cpu(tmp_path, monkeypatch):
    """Once the cycle calls PhaseHooks, every phase launch sits in one graphrt range (checked through
    the torch ranges, which a CPU-only profile records)."""
    from torch.profiler import ProfilerActivity, profile

    w = Workload(_cpu_workload_args(tmp_path, monkeypatch))
    with nvtx_ranges.torch_ranges(), profile(activities=[ProfilerActivity.CPU]) as prof:
        w.run()
    path = tmp_path / "kineto.json"
    prof.export_chrome_trace(str(path))
    ranges, _, _ = records_from_chrome_trace(load_chrome_trace(path))
    count = {}
    for r in ranges:
        count[r.name] = count.get(r.name, 0) + 1
        assert r.batch_size in (1, 2), r
    assert count["TARGET_VERIFY"] == count["DRAFT_EXTEND"] == count["DRAFT_DECODE"] > 0, count
    cycle_ranges = sorted((r for r in ranges if r.name != "PREFILL"), key=lambda r: r.start_ns)
    for a, b in zip(cycle_ranges, cycle_ranges[1:]):
        assert a.end_ns <= b.start_ns, (a, b)  # phase ranges do not nest or overlap


# ---- GPU: the real workload ------------------------------------------------------------------------


def _gpu_args(tmp_path, *extra):
    return _profile_args(["--preset", "tiny", "--batch-sizes", "1,4", "--max-new-tokens", "6",
                                         *extra])


@pytest.mark.gpu
def test_gpu_in_process_attribution(tmp_path):
    from graphrt.profiling.torch_profile import profile_callable

    w = Workload(_gpu_args(tmp_path), cupti_warmup=True)
    w.warm_up()
    r = profile_callable(w.run, trace_path=tmp_path / "kineto.json")
    assert sum(p.total_ns for p in r.phases.values()) + r.unattributed.total_ns == r.total_ns
    assert set(r.phases) >= {"TARGET_VERIFY", "DRAFT_EXTEND", "DRAFT_DECODE"}
    for p in r.phases.values():
        assert p.kernels > 0 and p.launches > 0, p.name
    print(report.format_table(r, expected_nodes=w.graph_nodes))
    for (phase, b), n in w.graph_nodes.items():  # a replay runs exactly its graph's kernel nodes
        cell = r.by_batch[(phase, b)]
        # Holds because conftest opens the CUPTI warm-up session before any graph is captured; without
        # it some driver stacks count extra kernels per TARGET_VERIFY replay.
        assert cell.kernels == n * cell.launches, (phase, b, cell.kernels / cell.launches, n, sorted(
            (k.count / cell.launches, name) for name, k in cell.kernels_by_name.items()))


@pytest.mark.gpu
def test_gpu_nsys_agrees_with_in_process(tmp_path):
    if shutil.which("nsys") is None:
        pytest.skip("nsys not on PATH")
    from graphrt.profiling.nsys_run import profile_under_nsys
    from graphrt.profiling.torch_profile import profile_callable

    args = _gpu_args(tmp_path, "--nsys-dir", str(tmp_path / "nsys"))
    sqlite, meta = profile_under_nsys(args)
    nsys = read_nsys_sqlite(sqlite)
    w = Workload(args)
    w.warm_up()
    torch_r = profile_callable(w.run)
    for name, p in torch_r.phases.items():  # same seeds, greedy: the same cycles in both processes
        q = nsys.phases[name]
        assert q.launches == pytest.approx(p.launches, rel=0.1), name
        assert q.kernels_per_launch == pytest.approx(p.kernels_per_launch), name
        assert q.mean_ns_per_launch == pytest.approx(p.mean_ns_per_launch, rel=0.05), name
        if name != "PREFILL":  # graph replays: the bar; eager PREFILL pays each tracer per API call
            assert q.mean_wall_ns_per_launch == pytest.approx(p.mean_wall_ns_per_launch, rel=0.02), name
    assert set(keyed_from_json(meta["cuda_events_traced_us"])) >= {(c.name, c.batch_size)
                                                                   for c in nsys.by_batch.values()}
    for key, n in meta.get("graph_kernel_nodes", {}).items():
        phase, b = key.rsplit("/", 1)
        cell = nsys.by_batch[(phase, int(b))]
        assert cell.kernels == n * cell.launches, (key, cell.kernels, cell.launches, n)
    out = io.StringIO()
    report.emit(nsys, argparse.Namespace(top=3), out=out)
    assert "TARGET_VERIFY" in out.getvalue()
