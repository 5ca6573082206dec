"""Read an Nsight Systems SQLite export (`nsys export --type sqlite`) into attribution records.

    NVTX_EVENTS (domain "graphrt", push/pop and start/end ranges)   -> PhaseRange
    CUPTI_ACTIVITY_KIND_RUNTIME (+ _DRIVER when present)            -> Launch
    CUPTI_ACTIVITY_KIND_KERNEL                                      -> Kernel
joined on (process id, correlationId): each process numbers its correlation ids from its own
counter, so the id alone is not unique in a multi-process capture.

Schema facts used (column names from NVIDIA's "SQLite Export Schema Reference"; see
tests/test_profiling.py for the hand-made files and tests/data for a real export):
  NVTX_EVENTS: start, end (NULL while a range is open), eventType, text (inline message) or
    textId -> StringIds.id (registered string; the python `nvtx` package always registers),
    domainId, globalTid, int64Value / uint64Value / int32Value / uint32Value (payload).
  eventType ids come from ENUM_NSYS_EVENT_TYPE (id, name) when the export has it; otherwise the
    long-stable values 59 NvtxPushPopRange, 60 NvtxStartEndRange, 75 NvtxDomainCreate. The domain
    create event carries the domain name in text and its id in domainId.
  CUPTI_ACTIVITY_KIND_RUNTIME: start, end, globalTid, correlationId, nameId -> StringIds.
  CUPTI_ACTIVITY_KIND_KERNEL: start, end, globalPid, correlationId, demangledName / shortName /
    mangledName -> StringIds.
  globalTid / globalPid serialise the process id in bits 24..47: pid = (globalTid >> 24) & 0xFFFFFF.

CUDA graphs: with `--cuda-graph-trace=node` every kernel node of a replay is a kernel row whose
correlationId is the cudaGraphLaunch's. With the default `--cuda-graph-trace=graph` a replay is one
row of CUPTI_ACTIVITY_KIND_GRAPH_TRACE and no kernel rows at all, so a per-phase kernel table
would read zero for every graph phase: read_nsys_sqlite raises NsysCaptureError saying so, unless
asked for graph_trace=True: then each replay becomes one record named GRAPH_REPLAY spanning it,
which gives phase wall times (node tracing slows replays; whole-graph tracing much less) and no
per-kernel detail.
"""

from __future__ import annotations

import sqlite3
from collections import defaultdict
from pathlib import Path

from graphrt.profiling.attribution import Attribution, Kernel, Launch, PhaseRange, ProfilingError, attribute
from graphrt.profiling.nvtx_ranges import DOMAIN

CAPTURE_HINT = ("capture with `nsys profile -t cuda,nvtx --cuda-graph-trace=node -o report <command>` "
                "(graphrt's ranges are on by default under nsys; GRAPHRT_NVTX=1 forces them), then "
                "`nsys export --type=sqlite report.nsys-rep`, or let `graphrt profile --nsys` do both")

_DEFAULT_EVENT_TYPES = {"NvtxPushPopRange": 59, "NvtxStartEndRange": 60, "NvtxDomainCreate": 75}
_GRAPH_LAUNCH_NAMES = ("cudaGraphLaunch", "cuGraphLaunch")
GRAPH_REPLAY = "cuda_graph_replay"  # the record standing for a whole replay in a graph-level trace


class NsysCaptureError(ProfilingError, ValueError):
    """The export lacks what the attribution needs; the message says how to capture it."""


def _pid(global_id: int | None) -> int:
    return ((global_id or 0) >> 24) & 0xFFFFFF


class _Db:
    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no such SQLite export: {self.path}")
        self.con = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            self.tables = {r[0] for r in self.con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        except sqlite3.DatabaseError as exc:
            raise NsysCaptureError(f"{self.path} is not an SQLite file ({exc}); export the .nsys-rep with "
                                   "`nsys export --type sqlite`") from None
        self._cols: dict[str, set[str]] = {}

    def columns(self, table: str) -> set[str]:
        if table not in self._cols:
            self._cols[table] = {r[1] for r in self.con.execute(f"PRAGMA table_info({table})")}
        return self._cols[table]

    def count(self, table: str, where: str = "1") -> int:
        if table not in self.tables:
            return 0
        return self.con.execute(f"SELECT count(*) FROM {table} WHERE {where}").fetchone()[0]

    def strings(self) -> dict[int, str]:
        if "StringIds" not in self.tables:
            return {}
        return dict(self.con.execute("SELECT id, value FROM StringIds"))

    def event_types(self) -> dict[str, int]:
        out = dict(_DEFAULT_EVENT_TYPES)
        if "ENUM_NSYS_EVENT_TYPE" in self.tables and "name" in self.columns("ENUM_NSYS_EVENT_TYPE"):
            for i, name in self.con.execute("SELECT id, name FROM ENUM_NSYS_EVENT_TYPE"):
                if name in out:
                    out[name] = i
        return out


def _text_expr(db: _Db, alias: str) -> str:
    cols = db.columns("NVTX_EVENTS")
    parts = []
    if "text" in cols:
        parts.append(f"{alias}.text")
    if "textId" in cols and "StringIds" in db.tables:
        parts.append(f"(SELECT value FROM StringIds WHERE id = {alias}.textId)")
    return f"COALESCE({', '.join(parts)})" if len(parts) > 1 else (parts[0] if parts else "NULL")


def read_ranges(db: _Db, domain: str | None = DOMAIN) -> list[PhaseRange]:
    if "NVTX_EVENTS" not in db.tables:
        raise NsysCaptureError(f"{db.path}: no NVTX_EVENTS table (the capture traced no NVTX); {CAPTURE_HINT}")
    cols = db.columns("NVTX_EVENTS")
    et = db.event_types()
    text = _text_expr(db, "n")
    payload_cols = [c for c in ("int64Value", "uint64Value", "int32Value", "uint32Value") if c in cols]
    payload = f"COALESCE({', '.join('n.' + c for c in payload_cols)})" if payload_cols else "NULL"
    has_domain = "domainId" in cols

    where = [f"n.eventType IN ({et['NvtxPushPopRange']}, {et['NvtxStartEndRange']})", "n.end IS NOT NULL"]
    if domain is not None:
        # (pid, domainId) of every "graphrt" domain: domain ids are per process.
        rows = db.con.execute(
            f"SELECT n.globalTid, {'n.domainId' if has_domain else '0'}, {text} FROM NVTX_EVENTS n "
            f"WHERE n.eventType = {et['NvtxDomainCreate']}").fetchall()
        mine = {(_pid(g), d) for g, d, name in rows if name == domain}
        if not mine:
            names = sorted({name for _, _, name in rows if name})
            n_ranges = db.count("NVTX_EVENTS", f"eventType IN ({et['NvtxPushPopRange']}, {et['NvtxStartEndRange']})")
            raise NsysCaptureError(
                f"{db.path}: no NVTX domain {domain!r} (domains in the capture: {names or 'none'}; "
                f"{n_ranges} NVTX ranges in all). graphrt emits its phase ranges in domain {domain!r} "
                f"when NVTX is on: run with GRAPHRT_NVTX=1, or call "
                f"graphrt.profiling.nvtx_ranges.enable_nvtx(); {CAPTURE_HINT}")
    out = []
    q = (f"SELECT n.start, n.end, n.globalTid, {'n.domainId' if has_domain else '0'}, {text}, {payload} "
         f"FROM NVTX_EVENTS n WHERE {' AND '.join(where)}")
    for start, end, gtid, dom, name, pl in db.con.execute(q):
        if domain is not None and (_pid(gtid), dom) not in mine:
            continue
        out.append(PhaseRange(name or "", None if pl is None else int(pl), int(start), int(end), gtid))
    if not out:
        raise NsysCaptureError(f"{db.path}: the NVTX domain {domain!r} holds no closed ranges; was the "
                               f"workload's decode loop inside the capture window?")
    return out


def read_launches(db: _Db, strings: dict[int, str]) -> list[Launch]:
    tables = [t for t in ("CUPTI_ACTIVITY_KIND_RUNTIME", "CUPTI_ACTIVITY_KIND_DRIVER") if t in db.tables]
    if not tables:
        raise NsysCaptureError(f"{db.path}: no CUPTI_ACTIVITY_KIND_RUNTIME table (the capture traced no CUDA "
                               f"API calls); {CAPTURE_HINT}")
    out = []
    for t in tables:
        name_col = "nameId" if "nameId" in db.columns(t) else "NULL"
        for start, end, gtid, corr, nid in db.con.execute(
                f"SELECT start, end, globalTid, correlationId, {name_col} FROM {t} WHERE correlationId IS NOT NULL"):
            out.append(Launch((_pid(gtid), corr), int(start), int(end), gtid, strings.get(nid, "")))
    return out


def read_kernels(db: _Db, strings: dict[int, str]) -> list[Kernel]:
    """Every kernel row (none when the capture traced no kernels)."""
    t = "CUPTI_ACTIVITY_KIND_KERNEL"
    if t not in db.tables:
        return []
    cols = db.columns(t)
    names = [c for c in ("demangledName", "shortName", "mangledName") if c in cols]
    pid_col = "globalPid" if "globalPid" in cols else ("globalTid" if "globalTid" in cols else "0")
    out = []
    for row in db.con.execute(f"SELECT start, end, {pid_col}, correlationId, {', '.join(names) or 'NULL'} FROM {t}"):
        start, end, gpid, corr = row[:4]
        name = next((strings[i] for i in row[4:] if i is not None and strings.get(i)), "?")
        out.append(Kernel((_pid(gpid), corr), int(start), int(end), name))
    return out


def read_graph_replays(db: _Db) -> list[Kernel]:
    """One GRAPH_REPLAY record per row of CUPTI_ACTIVITY_KIND_GRAPH_TRACE (a whole replay)."""
    t = "CUPTI_ACTIVITY_KIND_GRAPH_TRACE"
    if not db.count(t):
        raise NsysCaptureError(f"{db.path}: no CUPTI_ACTIVITY_KIND_GRAPH_TRACE rows, so no graph was traced whole: "
                               f"read a `--cuda-graph-trace=node` capture without --graph-trace")
    pid_col = "globalPid" if "globalPid" in db.columns(t) else "0"
    return [Kernel((_pid(gpid), corr), int(start), int(end), GRAPH_REPLAY)
            for start, end, gpid, corr in db.con.execute(f"SELECT start, end, {pid_col}, correlationId FROM {t}")]


def _check_node_trace(db: _Db, launches: list[Launch], kernels: list[Kernel]) -> str | None:
    """Raises when the capture holds no kernels, or lacks the kernels of graph replays (it did not
    trace graph nodes); returns a note when only some graph launches lack them."""
    graph_launches = [ln for ln in launches if ln.name.startswith(_GRAPH_LAUNCH_NAMES)]
    with_kernels = {k.correlation_id for k in kernels}
    bare = [ln for ln in graph_launches if ln.correlation_id not in with_kernels]
    n_whole = db.count("CUPTI_ACTIVITY_KIND_GRAPH_TRACE")
    if n_whole and (bare or not kernels):
        raise NsysCaptureError(
            f"{db.path}: CUDA graphs were traced as whole graphs ({n_whole} rows in "
            f"CUPTI_ACTIVITY_KIND_GRAPH_TRACE, no per-kernel rows for their replays: `--cuda-graph-trace=graph`, "
            f"nsys's default). Per-phase kernel attribution needs every kernel node: re-capture with "
            f"`--cuda-graph-trace=node` ({CAPTURE_HINT}).")
    if not kernels:
        raise NsysCaptureError(f"{db.path}: no CUPTI_ACTIVITY_KIND_KERNEL rows (no GPU kernels were traced); "
                               f"{CAPTURE_HINT}")
    if bare and len(bare) == len(graph_launches):
        raise NsysCaptureError(
            f"{db.path}: none of the {len(graph_launches)} graph launches has a kernel row: the capture "
            f"did not trace CUDA graph nodes; re-capture with `--cuda-graph-trace=node` ({CAPTURE_HINT}).")
    if bare:
        return (f"{len(bare)} of {len(graph_launches)} graph launches have no kernel rows "
                f"(graphs of memcpy/memset nodes only, or dropped records)")
    return None


def read_nsys_sqlite(path, *, domain: str | None = DOMAIN, graph_trace: bool = False) -> Attribution:
    """Per-phase kernel-time attribution from an `nsys export --type sqlite` file.

    domain: the NVTX domain holding the phase ranges ("graphrt"); None takes ranges from every
    domain. graph_trace: the capture traced graphs whole (`--cuda-graph-trace=graph`); each replay
    is then one GRAPH_REPLAY record. Raises NsysCaptureError naming what the capture lacks and how
    to capture it."""
    db = _Db(path)
    try:
        if not db.tables:
            raise NsysCaptureError(f"{db.path}: empty database; {CAPTURE_HINT}")
        strings = db.strings()
        ranges = read_ranges(db, domain)
        launches = read_launches(db, strings)
        kernels = read_kernels(db, strings)
        if graph_trace:
            result = attribute(ranges, launches, kernels + read_graph_replays(db),
                               source=f"nsys sqlite {db.path.name}, graphs traced whole")
            result.notes.append(f"graphs traced whole (--cuda-graph-trace=graph): a replay is one "
                                f"{GRAPH_REPLAY} record, wall times only, no kernels inside graphs")
        else:
            note = _check_node_trace(db, launches, kernels)
            result = attribute(ranges, launches, kernels, source=f"nsys sqlite {db.path.name}")
            result.notes += [note] if note else []
        per_pid = defaultdict(int)
        for r in ranges:
            per_pid[_pid(r.tid)] += 1
        if len(per_pid) > 1:
            result.notes.append(f"phase ranges from {len(per_pid)} processes are summed")
        return result
    finally:
        db.con.close()
