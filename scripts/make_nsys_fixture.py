"""Record a small real Nsight Systems export of graphrt's own workload for the CPU tests.

tests/data/nsys_tiny.sqlite and tests/data/nsys_pdl.sqlite are such exports.

How the committed files were made (run on the GPU machine, from the repository root):

    source .gpu-carry/env.sh            # nvtx wheel, nsys on PATH, graphrt installed editable
    python scripts/make_nsys_fixture.py --out-dir "$OUT"
    python scripts/make_nsys_fixture.py --out-dir "$OUT" --name nsys_pdl --expect-pdl \
        --preset llama-1b-shape --max-new-tokens 4

each of which runs

    nsys profile --trace=cuda,nvtx --cuda-graph-trace=node --sample=none --cpuctxsw=none \
        --force-overwrite=true --output=<tmp>/graphrt python -m graphrt profile --preset tiny --draft-kind lm \
        --batch-sizes 1,4 --max-new-tokens 6 --prompt-len 8 --_inner --_meta <tmp>/meta.json
    nsys export --type=sqlite --force-overwrite=true --output=<tmp>/graphrt.sqlite <tmp>/graphrt.nsys-rep

(a random preset, bf16, self-draft, K = 3, CUDA graphs for buckets 1 and 4; a short warm-up
with NVTX off, then a handful of cycles at each batch size inside graphrt's NVTX ranges), then
shrinks the export: keeps only the tables the reader uses (StringIds, NVTX_EVENTS,
CUPTI_ACTIVITY_KIND_RUNTIME, CUPTI_ACTIVITY_KIND_KERNEL, ENUM_NSYS_EVENT_TYPE, META_DATA_EXPORT and
CUPTI_ACTIVITY_KIND_GRAPH_TRACE if present), drops NVTX events of other domains (domain-create
events stay), API calls that launched no kernel, and unreferenced strings, and VACUUMs.
It writes beside it <name>.expected.json: the attribution computed from the full, unshrunk export
(so the test proves shrinking changed nothing) plus the captured graphs' kernel-node counts. Copy
both files from $OUT into tests/data/ and commit them.

nsys_tiny was recorded before graphrt launched kernels as programmatic dependents (PDL): none of its
kernels overlap. nsys_pdl is recorded on llama-1b-shape, the issue's workload, with PDL on (the
default, sm_90+), where kernels start before their producer ends; --expect-pdl refuses to write
the files unless some kernel of a phase launch waited (critical_path.py), so the tests that read
them check real waits.
"""

from __future__ import annotations

import argparse
import json
import os
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


def waits_ns(result) -> int:
    """Time kernels of phase launches spent overlapped by earlier ones (under PDL: waiting)."""
    return sum(k.wait_ns for path in result.paths for k in path.kernels)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default="tests/data", help="where to write the two fixture files")
    ap.add_argument("--work-dir", help="keep the full report here (default: a temporary directory)")
    ap.add_argument("--name", default="nsys_tiny", help="the files are NAME.sqlite and NAME.expected.json")
    ap.add_argument("--preset", default="tiny", help="embedded random preset profiled")
    ap.add_argument("--batch-sizes", default="1,4")
    ap.add_argument("--max-new-tokens", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--expect-pdl", action="store_true",
                    help="refuse to write the fixture unless some kernel waited for its producer (PDL in effect)")
    a = ap.parse_args(argv)

    from graphrt.profiling import report
    from graphrt.profiling.nsys_run import nsys_profile_flags, run_nsys
    from graphrt.profiling.nsys_sqlite import read_nsys_sqlite
    from graphrt.profiling.workload import keyed_from_json

    if a.expect_pdl and os.environ.get("GRAPHRT_PDL") == "0":
        raise SystemExit("--expect-pdl with GRAPHRT_PDL=0: unset it")
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="graphrt-fixture-"))
    meta_path = work / "meta.json"
    inner = [sys.executable, "-m", "graphrt", "profile", "--preset", a.preset, "--draft-kind", "lm",  # the fixtures'
             "--batch-sizes", a.batch_sizes,
             "--max-new-tokens", str(a.max_new_tokens), "--prompt-len", str(a.prompt_len), "--_inner", "--_meta",
             str(meta_path)]
    full = run_nsys(inner, work)
    before = read_nsys_sqlite(full)
    if a.expect_pdl and not waits_ns(before):
        raise SystemExit(f"no kernel of a phase launch started before its predecessor ended in {full}: PDL was "
                         f"not in effect (it needs sm_90+ and GRAPHRT_PDL unset or 1); not writing the fixture")
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dst = out / f"{a.name}.sqlite"
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
    meta["command"] = " ".join(["nsys profile", *nsys_profile_flags(), "--output=<tmp>/graphrt", "python", *inner[1:]])
    meta["waits_ns"] = waits_ns(before)
    try:
        meta["nsys_version"] = subprocess.run(["nsys", "--version"], capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    expected = out / f"{a.name}.expected.json"
    expected.write_text(json.dumps({"meta": meta, "attribution": jb}, indent=2))
    print(report.format_table(after, expected_nodes=keyed_from_json(meta.get("graph_kernel_nodes")),
                              events_traced=keyed_from_json(meta.get("cuda_events_traced_us"))))
    print(f"wrote {dst} ({size / 1024:.0f} KiB) and {expected}; full report in {work}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
