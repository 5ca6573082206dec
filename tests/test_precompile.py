"""The parallel precompile before capture (the phases', then the prefill graphs'): it compiles each
variant once, leaves capture bit-exact, and a later capture of the same configuration (Triton's disk
cache warm) skips it."""

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
rt.capture(prefill=True)
diffs = [d for b in (1, 4) for d in compare_replay_to_eager(rt, b).values()]
g = rt.cycle.graphs
print(json.dumps({"precompiled": g.precompiled, "prefill_precompiled": g.prefill_precompiled, "exact": not any(diffs),
                  "prefill_graphs": len(g.prefills)}))
"""


_KEYS = """
import json, sys
import graphrt.kernels.attention, graphrt.kernels.argmax, graphrt.kernels.rejection, graphrt.kernels.qkv_rotary
from graphrt.capture.precompile import kernel_modules, stable_cache_keys
from triton.runtime.jit import JITFunction

modules = kernel_modules()
fns = [v for m in modules for v in vars(sys.modules[m]).values() if isinstance(v, JITFunction)]
for fn in (fns if sys.argv[1] == "forward" else fns[::-1]):
    fn.cache_key  # what launching them in this order would compute
stable_cache_keys(modules)
print(json.dumps({f"{fn.__module__}.{fn._fn_name}": fn.cache_key for fn in fns}))
"""


def test_cache_keys_do_not_depend_on_launch_order():
    # Without stable_cache_keys, Triton 3.6 gave a kernel a key that depended on which kernels the
    # process had touched first, and workers' compiles missed the parent's disk cache.
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # real JITFunctions; computing keys needs no GPU
    keys = [json.loads(subprocess.run([sys.executable, "-c", _KEYS, order], env=env, capture_output=True, text=True,
                                      check=True, timeout=300).stdout) for order in ("forward", "reverse")]
    assert len(keys[0]) > 20 and keys[0] == keys[1]


def test_marker_names_configuration_and_sources():
    from graphrt.capture.precompile import _marker

    a, b = _marker("cfg-a"), _marker("cfg-b")
    assert a == _marker("cfg-a") and a != b
    assert os.path.basename(os.path.dirname(a)) == "graphrt-precompiled"


@pytest.mark.gpu
def test_cold_capture_precompiles_then_warm_capture_skips(tmp_path):
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"))
    env.pop("TRITON_INTERPRET", None)
    runs, entries = [], []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _CAPTURE], env=env, capture_output=True, text=True,
                             timeout=600, cwd=os.path.dirname(os.path.dirname(__file__)))
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        entries.append(set(os.listdir(tmp_path / "triton")))
    assert runs[0]["precompiled"] > 5 and runs[0]["exact"]
    assert runs[1]["precompiled"] == 0 and runs[1]["exact"]
    # the prefill graphs' own variants (the attention's, at each padded length) before their warm-ups
    assert runs[0]["prefill_precompiled"] > 0 and runs[1]["prefill_precompiled"] == 0
    assert runs[0]["prefill_graphs"] == runs[1]["prefill_graphs"] > 4
    assert entries[1] == entries[0], "the warm capture compiled again"
    assert os.listdir(tmp_path / "triton" / "graphrt-precompiled")


def test_jobs_are_split_longest_first_each_once():
    import graphrt.kernels.argmax
    import graphrt.kernels.attention  # noqa: F401
    from graphrt.capture.precompile import _balanced

    long, short = ("graphrt.kernels.attention", "_paged_attn_partial_kernel"), ("graphrt.kernels.argmax",
                                                                             "_argmax_combine_kernel")
    jobs = [(*long, f"l{i}") for i in range(3)] + [(*short, f"s{i}") for i in range(6)]
    shares = _balanced(jobs, 3)
    assert sorted(j for s in shares for j in s) == sorted(jobs)
    assert all(s[0][1] == long[1] for s in shares)  # each worker starts on one of the slow kernels
    assert _balanced([], 2) == [[], []]


def test_server_runs_its_workers_and_reports_a_failure():
    """The workers' parent with nothing to read (its parent gone) or no shares exits cleanly; a
    worker that fails makes it exit 1 with the worker's traceback."""
    run = lambda text: subprocess.run([sys.executable, "-m", "graphrt.capture.precompile"], input=text,
                                      capture_output=True, text=True, timeout=300)
    assert run("").returncode == 0
    bad = run(json.dumps({"modules": [], "gpu": "0", "shares": [[], [["graphrt.kernels.no_such_module", "k", "{}"]]]}))
    assert bad.returncode == 1 and "No module named 'graphrt.kernels.no_such_module'" in bad.stderr


def test_an_early_server_is_taken_once_or_stopped():
    from graphrt.capture import precompile

    precompile.start_early()
    server, _ = precompile._early
    precompile.start_early()  # one waits at a time
    assert precompile._early[0] is server and server.poll() is None
    precompile._stop_early()
    assert precompile._early is None and server.returncode is not None
    precompile.start_early()
    taken = precompile._take_server()
    assert precompile._early is None and taken[0].poll() is None
    taken[0].stdin.close()  # nothing to do: it exits once its imports are done
    assert taken[0].wait(timeout=300) == 0
    taken[1].close()
