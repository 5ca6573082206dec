"""Fresh random seeds that a failing run can replay.

Each run draws one base seed (printed at the end of the run); every `fresh_seed()` call derives its
seed from the base, the test's id and how many seeds that test drew before, so
`GRAPHRT_TEST_SEED=<base> pytest ...` replays any test exactly, alone or in the whole suite.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter

BASE = int(os.environ.get("GRAPHRT_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
_drawn: Counter[str] = Counter()


def fresh_seed() -> int:
    """A 32-bit seed, new for every call, determined by the run's base seed."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    n = _drawn[test]
    _drawn[test] += 1
    return named_seed(f"{test}/{n}")


def named_seed(label: str) -> int:
    """A 32-bit seed for label, determined by the run's base seed: fresh_seed's draws, and code that
    runs outside any one test (a module fixture, whichever test needs it first) or before any runs
    (a hypothesis test's seed)."""
    return int.from_bytes(hashlib.blake2b(f"{BASE}/{label}".encode(), digest_size=4).digest(), "little")
