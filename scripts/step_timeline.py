"""Where a captured phase's time goes when its kernels overlap (PDL): each kernel's share of the
critical path, from an nsys SQLite export (`graphrt profile --nsys --nsys-dir DIR` leaves DIR/graphrt.sqlite).

    python scripts/step_timeline.py DIR/graphrt.sqlite [--phase TARGET_DECODE] [--json f.json]

Under programmatic dependent launch a kernel starts (and prefetches) before the kernel it waits
on has finished, so its nsys duration includes time the step spends elsewhere and durations no
longer add up to the step. Ordered by end time within one replay, kernel i's critical-path share
is end_i - end_(i-1) (the first kernel's is measured from the range's first kernel start): the
shares sum to the replay's span, and a kernel that finished its work behind the previous one's
costs the step only the time after it. Printed per kernel name, averaged over the phase's replays:
launches per replay, mean duration, mean share, and how early it started (end_(i-1) - start_i).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

from graphrt.profiling.attribution import short_kernel_name
from graphrt.profiling.nsys_sqlite import _Db, read_kernels, read_launches, read_ranges


def shares(sqlite: str, phase: str) -> tuple[int, dict[str, dict[str, float]]]:
    db = _Db(sqlite)
    strings = db.strings()
    ranges = [r for r in read_ranges(db) if r.name == phase]
    launches = [x for x in read_launches(db, strings) if "GraphLaunch" in x.name]
    by_corr = defaultdict(list)
    for k in read_kernels(db, strings):
        by_corr[k.correlation_id].append(k)
    acc = defaultdict(lambda: defaultdict(float))
    replays = 0
    for r in ranges:
        # A replay's kernels carry the correlation id of the graph launch made inside the range.
        mine = sorted((k for x in launches if x.tid == r.tid and r.start_ns <= x.start_ns <= r.end_ns
                       for k in by_corr[x.correlation_id]), key=lambda k: k.end_ns)
        if not mine:
            continue
        replays += 1
        prev_end = min(k.start_ns for k in mine)
        for k in mine:
            a = acc[short_kernel_name(k.name)]
            a["count"] += 1
            a["duration_ns"] += k.end_ns - k.start_ns
            a["share_ns"] += k.end_ns - prev_end
            a["lead_ns"] += max(0, prev_end - k.start_ns)
            prev_end = k.end_ns
    return replays, acc


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sqlite")
    ap.add_argument("--phase", default="TARGET_DECODE")
    ap.add_argument("--json")
    args = ap.parse_args()
    n, acc = shares(args.sqlite, args.phase)
    if not n:
        raise SystemExit(f"no {args.phase} replays with kernels in {args.sqlite}")
    rows = sorted(({"kernel": name, "per_replay": a["count"] / n, "duration_us": a["duration_ns"] / a["count"] / 1e3,
                    "share_us": a["share_ns"] / a["count"] / 1e3, "lead_us": a["lead_ns"] / a["count"] / 1e3,
                    "share_per_replay_us": a["share_ns"] / n / 1e3} for name, a in acc.items()),
                  key=lambda r: -r["share_per_replay_us"])
    total = sum(r["share_per_replay_us"] for r in rows)
    print(f"{args.phase}: {n} replays, {total:.1f} us of critical path per replay")
    print(f"{'kernel':<48} {'per replay':>10} {'duration us':>11} {'share us':>9} {'lead us':>8} {'share/replay':>12}")
    for r in rows:
        print(f"{r['kernel'][:48]:<48} {r['per_replay']:>10.1f} {r['duration_us']:>11.2f} {r['share_us']:>9.2f} "
              f"{r['lead_us']:>8.2f} {r['share_per_replay_us']:>12.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(phase=args.phase, replays=n, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
