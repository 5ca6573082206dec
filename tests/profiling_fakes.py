"""Nsight Systems SQLite exports built by hand, with the export schema's table and column names, for
the profiling tests (tests/test_profiling.py, tests/test_trace_readers.py)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from graphrt.profiling.attribution import short_kernel_name

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
