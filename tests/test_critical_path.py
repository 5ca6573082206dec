"""Wall, exclusive, wait and gap times (profiling/critical_path.py): hand-made launches, random
ones against a brute force over integer time points, and the committed Nsight exports (the tiny
one, and the one recorded with PDL on, where kernels really wait)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
from graphrt.profiling import report
from graphrt.profiling.critical_path import critical_paths, split_launch
from graphrt.profiling.nsys_sqlite import read_nsys_sqlite

DATA = Path(__file__).parent / "data"
TINY = DATA / "nsys_tiny.sqlite"
PDL = DATA / "nsys_pdl.sqlite"


def _figures(path):
    return [(k.name, k.exclusive_ns, k.wait_ns, k.gap_ns) for k in path.kernels]


def test_serial_kernels_with_launch_gaps():
    p = split_launch("L", [(12, 20, "b"), (0, 10, "a"), (20, 25, "c")])  # any order in
    assert (p.start_ns, p.end_ns, p.wall_ns) == (0, 25, 25)
    # b starts 2 ns after a ends: the idle gap is b's to answer for
    assert _figures(p) == [("a", 10, 0, 0), ("b", 10, 0, 2), ("c", 5, 0, 0)]


def test_pdl_kernels_start_early_and_wait():
    # b is scheduled 6 ns before a ends and waits; c overlaps b by 1 ns
    p = split_launch("L", [(0, 10, "a"), (4, 15, "b"), (14, 30, "c")])
    assert _figures(p) == [("a", 10, 0, 0), ("b", 5, 6, 0), ("c", 15, 1, 0)]
    assert sum(k.duration_ns for k in p.kernels) == 37 and p.wall_ns == 30


def test_kernel_inside_another_costs_nothing():
    p = split_launch("L", [(0, 10, "long"), (2, 5, "inside"), (2, 5, "twin"), (10, 10, "empty")])
    assert _figures(p) == [("long", 10, 0, 0), ("inside", 0, 3, 0), ("twin", 0, 3, 0), ("empty", 0, 0, 0)]


def test_bad_input():
    with pytest.raises(ValueError, match="no kernels"):
        split_launch("L", [])
    with pytest.raises(ValueError, match="ends before it starts"):
        split_launch("L", [(5, 4, "k")])


def test_critical_paths_groups_by_launch_in_first_seen_order():
    paths = critical_paths([("B", 10, 20, "x"), ("A", 0, 5, "y"), ("B", 0, 8, "z")])
    assert list(paths) == ["B", "A"]
    assert paths["B"].wall_ns == 20 and [k.name for k in paths["B"].kernels] == ["z", "x"]


@pytest.mark.parametrize("seed", range(30))
def test_random_launches_against_time_points(seed):
    rng = random.Random(seed)
    ks = []
    for i in range(rng.randint(1, 12)):
        s = rng.randint(0, 120)
        ks.append((s, s + rng.randint(0, 40), f"k{i}"))
    p = split_launch("L", ks)
    assert sum(k.exclusive_ns for k in p.kernels) == p.wall_ns == max(e for _, e, _ in ks) - min(s for s, _, _ in ks)
    covered: set[int] = set()  # integer points t, each standing for [t, t + 1)
    for k in p.kernels:
        mine = set(range(k.start_ns, k.end_ns))
        assert k.wait_ns == len(mine & covered), k  # overlapped by kernels that started earlier
        assert k.duration_ns + k.gap_ns == k.wait_ns + k.exclusive_ns
        covered |= mine
    idle = set(range(p.start_ns, p.end_ns)) - covered
    assert sum(k.gap_ns for k in p.kernels) == len(idle)
    assert sum(k.exclusive_ns - k.gap_ns for k in p.kernels) == len(covered)


def _check_laws(r):
    """Per launch: exclusive times add up to the wall exactly, the wall covers the longest kernel,
    and each kernel's duration + gap = wait + exclusive. Per cell and phase: the same sums."""
    assert r.paths
    for path in r.paths:
        ks = path.kernels
        assert sum(k.exclusive_ns for k in ks) == path.wall_ns
        assert path.wall_ns >= max(k.duration_ns for k in ks)
        assert all(k.duration_ns + k.gap_ns == k.wait_ns + k.exclusive_ns for k in ks)
        assert all(min(k.exclusive_ns, k.wait_ns, k.gap_ns) >= 0 for k in ks)
    for key, cell in r.by_batch.items():
        walls = [p.wall_ns for p in r.paths if (p.launch.name, p.launch.batch_size) == key]
        assert cell.wall_ns == sum(walls)
        assert sum(k.exclusive_ns for k in cell.kernels_by_name.values()) == cell.wall_ns
        assert cell.total_ns == sum(k.total_ns for k in cell.kernels_by_name.values())
    assert sum(p.total_ns for p in r.phases.values()) + r.unattributed.total_ns == r.total_ns
    assert sum(p.wall_ns for p in r.phases.values()) == sum(p.wall_ns for p in r.paths)


def test_committed_tiny_export():
    if not TINY.exists():
        pytest.skip(f"{TINY} not made yet: run scripts/make_nsys_fixture.py on the GPU machine")
    r = read_nsys_sqlite(TINY)
    _check_laws(r)
    for path in r.paths:
        # Recorded before graphrt launched kernels with PDL: nothing overlaps, so each exclusive
        # time is end - previous end, what scripts/step_timeline.py used to compute.
        prev = path.start_ns
        for k in path.kernels:
            assert (k.wait_ns, k.exclusive_ns) == (0, k.end_ns - prev)
            prev = k.end_ns
    tv = r.by_batch[("TARGET_VERIFY", 1)]
    assert tv.wall_ns > tv.total_ns  # launch gaps between graph nodes: wall > sum of durations here


def _pdl_export():
    if not PDL.exists():
        pytest.skip(f"{PDL} not recorded yet: on the GPU machine run `python scripts/make_nsys_fixture.py "
                    f"--name nsys_pdl --expect-pdl --preset llama-1b-shape --max-new-tokens 4 --out-dir $OUT` "
                    f"and commit both files into tests/data")
    return read_nsys_sqlite(PDL)


def test_committed_pdl_export_waits_are_real():
    r = _pdl_export()
    _check_laws(r)
    waiting = [k for p in r.paths for k in p.kernels if k.wait_ns > 0]
    assert waiting, "no kernel of the PDL export starts before its predecessor ends"
    # the sum of durations overstates the wall by the waits and understates it by the gaps
    for cell in r.by_batch.values():
        ks = cell.kernels_by_name.values()
        assert cell.total_ns == cell.wall_ns + sum(k.wait_ns for k in ks) - sum(k.gap_ns for k in ks)


def test_committed_pdl_export_reads_as_recorded():
    r = _pdl_export()
    expected = json.loads((DATA / "nsys_pdl.expected.json").read_text())
    got = report.to_json(r, top=None)
    got.pop("source")
    for cell in got["by_batch"]:  # the committed file predates the family split: checked against the wall
        families = cell.pop("families_us")
        if families is not None:
            assert sum(families.values()) == pytest.approx(cell["mean_wall_ns_per_launch"] / 1e3), cell["phase"]
    for cell in expected["attribution"]["by_batch"]:
        cell.pop("families_us", None)
    assert got == expected["attribution"]  # the shrunk file reads exactly as the full export did
    for key, n in expected["meta"].get("graph_kernel_nodes", {}).items():
        phase, b = key.rsplit("/", 1)
        cell = r.by_batch.get((phase, int(b)))
        if cell is not None:
            assert cell.kernels == n * cell.launches, (key, cell.kernels, cell.launches, n)


def _overlapping_copy(src: Path, dst: Path) -> Path:
    """The tiny export with every other graph kernel moved up to 0.8 us before its predecessor's
    end, as PDL would start it."""
    import shutil
    import sqlite3

    shutil.copyfile(src, dst)
    con = sqlite3.connect(dst)
    prev: dict[int, int] = {}
    for rowid, start, corr in con.execute("SELECT rowid, start, correlationId FROM CUPTI_ACTIVITY_KIND_KERNEL "
                                          "WHERE graphNodeId IS NOT NULL ORDER BY correlationId, start").fetchall():
        if corr in prev and rowid % 2:
            start = max(prev[corr], start - 800)
            con.execute("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = ? WHERE rowid = ?", (start, rowid))
        prev[corr] = start
    con.commit()
    con.close()
    return dst


def test_fixture_maker_expect_pdl(tmp_path, monkeypatch, capsys):
    """scripts/make_nsys_fixture.py --expect-pdl on a stand-in for nsys: refuses an export where no
    kernel waited, writes one where kernels overlap, and what it writes passes the tests above."""
    from graphrt.profiling import nsys_run

    from tests.helpers import load_script

    if not TINY.exists():
        pytest.skip(f"{TINY} not made yet")
    maker = load_script("make_nsys_fixture")
    out = tmp_path / "out"
    args = ["--name", "nsys_pdl", "--expect-pdl", "--out-dir", str(out), "--work-dir", str(tmp_path / "work")]
    monkeypatch.setattr(nsys_run, "run_nsys", lambda *a, **kw: TINY)
    with pytest.raises(SystemExit, match="PDL was not in effect"):
        maker.main(args)
    assert not out.exists()
    full = _overlapping_copy(TINY, tmp_path / "full.sqlite")
    monkeypatch.setattr(nsys_run, "run_nsys", lambda *a, **kw: full)
    assert maker.main(args) == 0
    monkeypatch.setattr(sys.modules[__name__], "PDL", out / "nsys_pdl.sqlite")
    monkeypatch.setattr(sys.modules[__name__], "DATA", out)
    test_committed_pdl_export_waits_are_real()
    test_committed_pdl_export_reads_as_recorded()
