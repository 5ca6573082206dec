"""The parallel precompile before capture: it compiles each variant once, leaves capture bit-exact,
and a later capture of the same configuration (Triton's disk cache warm) skips it."""

import json
import os
import subprocess
import sys

import pytest

_CAPTURE = """
import json, sys, torch
from graphrt import Runtime
from graphrt.capture.validate import compare_replay_to_eager
from graphrt.checkpoint import load_checkpoint
from tests.helpers import draft_dir, tiny_dir

load = lambda p: load_checkpoint(p, dtype=torch.bfloat16, device="cuda")
rt = Runtime(load(tiny_dir()), load(draft_dir("eagle3")), num_draft_tokens=3, device="cuda", max_batch_size=4,
             max_seq_len=96, buckets=(1, 4), use_cuda_graphs=True)
rt.capture()
diffs = [d for b in (1, 4) for d in compare_replay_to_eager(rt, b).values()]
print(json.dumps({"precompiled": rt.cycle.graphs.precompiled, "exact": not any(diffs)}))
"""


def test_marker_names_configuration_and_sources():
    from graphrt.capture.precompile import _marker

    a, b = _marker("cfg-a"), _marker("cfg-b")
    assert a == _marker("cfg-a") and a != b
    assert os.path.basename(os.path.dirname(a)) == "graphrt-precompiled"


@pytest.mark.gpu
def test_cold_capture_precompiles_then_warm_capture_skips(tmp_path):
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"))
    env.pop("TRITON_INTERPRET", None)
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _CAPTURE], env=env, capture_output=True, text=True,
                             timeout=600, cwd=os.path.dirname(os.path.dirname(__file__)))
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert runs[0]["precompiled"] > 5 and runs[0]["exact"]
    assert runs[1]["precompiled"] == 0 and runs[1]["exact"]
    assert os.listdir(tmp_path / "triton" / "graphrt-precompiled")
