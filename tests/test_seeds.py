"""tests/seeds.py: fresh seeds differ call to call and test to test, and a base seed replays them."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import tests.seeds as seeds


def _draws(monkeypatch, base: int) -> list[int]:
    monkeypatch.setattr(seeds, "BASE", base)
    monkeypatch.setattr(seeds, "_drawn", Counter())
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/a.py::one (call)")
    run = [seeds.fresh_seed() for _ in range(3)]
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/a.py::two (call)")
    return run + [seeds.fresh_seed()]


def test_a_base_seed_replays_every_draw(monkeypatch):
    first, again, other = _draws(monkeypatch, 77), _draws(monkeypatch, 77), _draws(monkeypatch, 78)
    assert first == again
    assert len(set(first)) == 4 and all(0 <= s < 2**32 for s in first)
    assert other[0] != first[0]


def test_the_environment_sets_the_base():
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", "import tests.seeds as s; print(s.BASE)"], cwd=root, check=True,
                         capture_output=True, text=True, env={**os.environ, "GRAPHRT_TEST_SEED": "4242"})
    assert out.stdout.strip() == "4242"


def test_named_seeds_follow_the_base(monkeypatch):
    monkeypatch.setattr(seeds, "BASE", 77)
    a, b = seeds.named_seed("fuzz"), seeds.named_seed("other")
    assert a == seeds.named_seed("fuzz") and a != b and 0 <= a < 2**32
    monkeypatch.setattr(seeds, "BASE", 78)
    assert seeds.named_seed("fuzz") != a
