"""`graphrt profile --nsys`: re-run the same workload (`graphrt profile ... --_inner`) under
`nsys profile` and export SQLite (long options take `=`: the Nsight Systems user guide, "Command
Line Options").

The inner run warms up with NVTX off and emits phase ranges only around the measured decode, the
same part the in-process profiler sees, so both tables cover the same launches. It times that
decode with CUDA events too (under tracing) and writes them into its metadata.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from graphrt.profiling.attribution import ProfilingError


def nsys_profile_flags(cuda_graph_trace: str = "node") -> list[str]:
    """cuda_graph_trace: "node" (every kernel of a replay) or "graph" (each replay whole)."""
    return ["--trace=cuda,nvtx", f"--cuda-graph-trace={cuda_graph_trace}", "--sample=none", "--cpuctxsw=none",
            "--force-overwrite=true"]


def find_nsys() -> str:
    path = shutil.which("nsys")
    if path is None:
        raise ProfilingError("nsys (Nsight Systems CLI) is not on PATH: install Nsight Systems, or run "
                             "`graphrt profile` without --nsys (in-process PyTorch profiler), or capture elsewhere "
                             "and use --from-sqlite FILE")
    return path


def inner_command(args, meta_path: Path) -> list[str]:
    """The `graphrt profile --_inner` command line that reproduces args' workload."""
    cmd = [sys.executable, "-m", "graphrt", "profile"] + ([str(args.checkpoint)] if args.checkpoint else [])
    for flag, v in (("--preset", args.preset), ("--draft", args.draft), ("--draft-layers", args.draft_layers),
                    ("--draft-kind", args.draft_kind), ("--draft-quantization", args.draft_quantization),
                    ("--num-draft-tokens", args.num_draft_tokens), ("--device", args.device),
                    ("--dtype", args.dtype), ("--prompt-len", args.prompt_len),
                    ("--max-new-tokens", args.max_new_tokens), ("--accept-len", args.accept_len),
                    ("--batch-sizes", ",".join(map(str, args.batch_sizes)) if args.batch_sizes else None)):
        if v is not None:
            cmd += [flag, str(v)]
    cmd += [flag for flag, on in (("--no-draft", args.no_draft), ("--eager", args.eager)) if on]
    return cmd + ["--_inner", "--_meta", str(meta_path)]


def run_nsys(command: list[str], out_dir: Path, *, cuda_graph_trace: str = "node") -> Path:
    """Profile `command` under nsys into out_dir/graphrt.nsys-rep and export out_dir/graphrt.sqlite."""
    nsys = find_nsys()
    out_dir.mkdir(parents=True, exist_ok=True)
    base = out_dir / "graphrt"
    prof = [nsys, "profile", *nsys_profile_flags(cuda_graph_trace), f"--output={base}", *command]
    r = subprocess.run(prof, env={**os.environ, "GRAPHRT_NVTX": "1"})
    rep = next((p for p in (base.with_suffix(".nsys-rep"), base.with_suffix(".qdrep")) if p.exists()), None)
    if r.returncode != 0 or rep is None:
        raise ProfilingError(f"`{' '.join(prof)}` failed (exit {r.returncode}); see its output above")
    sqlite = base.with_suffix(".sqlite")
    exp = [nsys, "export", "--type=sqlite", "--force-overwrite=true", f"--output={sqlite}", str(rep)]
    r = subprocess.run(exp)
    if r.returncode != 0 or not sqlite.exists():
        raise ProfilingError(f"`{' '.join(exp)}` failed (exit {r.returncode})")
    return sqlite


def profile_under_nsys(args) -> tuple[Path, dict]:
    """Run args' workload under nsys; returns (SQLite export, the inner run's metadata)."""
    find_nsys()
    out_dir = Path(args.nsys_dir or tempfile.mkdtemp(prefix="graphrt-nsys-"))
    meta_path = out_dir / "meta.json"
    sqlite = run_nsys(inner_command(args, meta_path), out_dir,
                      cuda_graph_trace="graph" if args.graph_trace else "node")
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    print(f"graphrt profile: nsys report and SQLite export in {out_dir}", file=sys.stderr)
    return sqlite, meta
