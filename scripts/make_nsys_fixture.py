"""Make tests/data/nsys_tiny.sqlite: a small real Nsight Systems export of graphrt's own workload.

How the committed file was made (run on the GPU machine, from the repository root):

    source .gpu-carry/env.sh            # nvtx wheel, nsys on PATH, graphrt installed editable
    python scripts/make_nsys_fixture.py --out-dir "$OUT"

which runs

    nsys profile --trace=cuda,nvtx --cuda-graph-trace=node --sample=none --cpuctxsw=none \
        --force-overwrite=true --output=<tmp>/graphrt python -m graphrt profile --preset tiny \
        --batch-sizes 1,4 --max-new-tokens 6 --prompt-len 8 --_inner --_meta <tmp>/meta.json
    nsys export --type=sqlite --force-overwrite=true --output=<tmp>/graphrt.sqlite <tmp>/graphrt.nsys-rep

(tiny random preset, bf16, self-draft, K = 3, CUDA graphs for buckets 1 and 4; a short warm-up
with NVTX off, then a handful of cycles at each batch size inside graphrt's NVTX ranges), then
shrinks the export: keeps only the tables the reader uses (StringIds, NVTX_EVENTS,
CUPTI_ACTIVITY_KIND_RUNTIME, CUPTI_ACTIVITY_KIND_KERNEL, ENUM_NSYS_EVENT_TYPE, META_DATA_EXPORT and
CUPTI_ACTIVITY_KIND_GRAPH_TRACE if present), drops NVTX events of other domains (domain-create
events stay), API calls that launched no kernel, and unreferenced strings, and VACUUMs.
It writes beside it tests/data/nsys_tiny.expected.json: the attribution computed from the full,
unshrunk export (so the test proves shrinking changed nothing) plus the captured graphs'
kernel-node counts. Copy both files from $OUT into tests/data/ and commit them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

KEEP = ("StringIds", "NVTX_EVENTS", "CUPTI_ACTIVITY_KIND_RUNTIME", "CUPTI_ACTIVITY_KIND_KERNEL", "ENUM_NSYS_EVENT_TYPE",
        "META_DATA_EXPORT", "CUPTI_ACTIVITY_KIND_GRAPH_TRACE")
LIMIT_BYTES = 2 * 2**20


def shrink(src: Path, dst: Path, domain: str = "graphrt") -> None:
    shutil.copyfile(src, dst)
    con = sqlite3.connect(dst)
    tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    for t in sorted(tables - set(KEEP)):
        if not t.startswith("sqlite_"):
            con.execute(f'DROP TABLE "{t}"')
    ncols = {r[1] for r in con.execute("PRAGMA table_info(NVTX_EVENTS)")}
    # other domains' ranges and marks (domain-create events of every domain stay)
    et = {"NvtxDomainCreate": 75}
    if "ENUM_NSYS_EVENT_TYPE" in tables:
        et.update({n: i for i, n in con.execute("SELECT id, name FROM ENUM_NSYS_EVENT_TYPE")})
    doms = [d for (d,) in con.execute(
        "SELECT domainId FROM NVTX_EVENTS WHERE eventType = ? AND text = ?", (et["NvtxDomainCreate"], domain))]
    if doms and "domainId" in ncols:
        con.execute(f"DELETE FROM NVTX_EVENTS WHERE eventType != ? AND domainId NOT IN ({','.join('?' * len(doms))})",
                    (et["NvtxDomainCreate"], *doms))
    # API calls with no kernel (cudaMemcpyAsync, cudaStreamSynchronize, ...) cannot matter
    con.execute("DELETE FROM CUPTI_ACTIVITY_KIND_RUNTIME WHERE correlationId NOT IN "
                "(SELECT correlationId FROM CUPTI_ACTIVITY_KIND_KERNEL)")
    refs = []
    kcols = {r[1] for r in con.execute("PRAGMA table_info(CUPTI_ACTIVITY_KIND_KERNEL)")}
    for c in ("demangledName", "shortName", "mangledName"):
        if c in kcols:
            refs.append(f"SELECT {c} FROM CUPTI_ACTIVITY_KIND_KERNEL")
    refs.append("SELECT nameId FROM CUPTI_ACTIVITY_KIND_RUNTIME")
    if "textId" in ncols:
        refs.append("SELECT textId FROM NVTX_EVENTS WHERE textId IS NOT NULL")
    con.execute(f"DELETE FROM StringIds WHERE id NOT IN ({' UNION '.join(refs)})")
    con.commit()
    con.execute("VACUUM")
    con.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default="tests/data", help="where to write the two fixture files")
    ap.add_argument("--work-dir", help="keep the full report here (default: a temporary directory)")
    ap.add_argument("--batch-sizes", default="1,4")
    ap.add_argument("--max-new-tokens", type=int, default=6)
    a = ap.parse_args(argv)

    from graphrt.profiling import report
    from graphrt.profiling.nsys_run import NSYS_PROFILE_FLAGS, run_nsys
    from graphrt.profiling.nsys_sqlite import read_nsys_sqlite

    work = Path(a.work_dir or tempfile.mkdtemp(prefix="graphrt-fixture-"))
    meta_path = work / "meta.json"
    inner = [sys.executable, "-m", "graphrt", "profile", "--preset", "tiny", "--batch-sizes", a.batch_sizes,
             "--max-new-tokens", str(a.max_new_tokens), "--prompt-len", "8", "--_inner", "--_meta", str(meta_path)]
    full = run_nsys(inner, work)
    before = read_nsys_sqlite(full)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dst = out / "nsys_tiny.sqlite"
    shrink(full, dst)
    after = read_nsys_sqlite(dst)
    jb, ja = report.to_json(before, top=None), report.to_json(after, top=None)
    for j in (jb, ja):
        j.pop("source")
    if jb != ja:
        raise SystemExit("shrinking changed the attribution: refusing to write the fixture")
    size = dst.stat().st_size
    if size > LIMIT_BYTES:
        raise SystemExit(f"{dst} is {size / 2**20:.1f} MiB (> 2 MiB): lower --max-new-tokens")
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    meta["command"] = " ".join(["nsys profile", *NSYS_PROFILE_FLAGS, "--output=<tmp>/graphrt", "python", *inner[1:]])
    try:
        meta["nsys_version"] = subprocess.run(["nsys", "--version"], capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    (out / "nsys_tiny.expected.json").write_text(json.dumps({"meta": meta, "attribution": jb}, indent=2))
    print(report.format_table(after))
    print(f"wrote {dst} ({size / 1024:.0f} KiB) and {out / 'nsys_tiny.expected.json'}; full report in {work}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
