"""NVTX phase ranges (domain "graphrt") and PhaseHooks, the one object the cycle calls per phase.

Every phase launch, eager or graph replay, sits in exactly one range: message = phase name,
payload = batch size (NVTX_PAYLOAD_TYPE_INT64; Nsight's SQLite export puts it in
NVTX_EVENTS.int64Value). Ranges go around replays: a range pushed during capture covers only the
capture, never the replays.

Switches (all global, read at each phase call as one attribute of `_STATE`):
  NVTX   GRAPHRT_NVTX=1 in the environment, or enable_nvtx(); GRAPHRT_NVTX=0 / disable_nvtx() off.
         Unset: on exactly when an NVTX tool (nsys, ncu) is attached to the process, so
         `nsys profile python -m graphrt ...` gets ranges with no flag. With no tool attached the
         nvtx package hands out a dummy domain and nothing is emitted either way.
  torch  torch_ranges(): while active, each phase also opens a torch.profiler.record_function
         named "graphrt/<PHASE>/<B>" (torch_profile.py turns it on around its profiled run).

With everything off a phase call costs one attribute test; NVTX on adds a push and pop through
the nvtx C extension, and an attached tool its own cost on top.
"""

from __future__ import annotations

import os
from contextlib import nullcontext

DOMAIN = "graphrt"
TORCH_PREFIX = "graphrt/"
_NULL = nullcontext()


class _State:
    __slots__ = ("nvtx", "torch", "active", "domain", "attrs", "category", "push", "pop")

    def __init__(self):
        self.nvtx = False  # ranges are emitted (requested and a real domain exists)
        self.torch = False  # record_function ranges are opened
        self.active = False  # nvtx or torch: the one check on the hot path
        self.domain = None
        self.attrs: dict[tuple[str, int], object] = {}  # (phase, B) -> nvtx EventAttributes
        self.category = None
        self.push = self.pop = None  # nvtx._lib push_range / pop_range, bound with the domain


_STATE = _State()


def _refresh() -> None:
    _STATE.active = _STATE.nvtx or _STATE.torch


def _domain():
    """The cached nvtx Domain for "graphrt", or None when the nvtx package or a tool is absent."""
    if _STATE.domain is None:
        try:
            import nvtx
        except ImportError:
            return None
        d = nvtx.get_domain(DOMAIN)
        _STATE.domain = None if d is nvtx._lib.dummy_domain else d
        _STATE.push, _STATE.pop = nvtx._lib.push_range, nvtx._lib.pop_range
    return _STATE.domain


def enable_nvtx(on: bool | None = True) -> bool:
    """Switch NVTX phase ranges on (True), off (False) or to auto (None: on when a tool is
    attached). Returns whether ranges are now emitted."""
    want = on if on is not None else True  # auto: on iff a tool gave a real domain
    _STATE.nvtx = bool(want) and _domain() is not None
    _refresh()
    return _STATE.nvtx


def disable_nvtx() -> None:
    enable_nvtx(False)


def _env_setting() -> bool | None:
    v = os.environ.get("GRAPHRT_NVTX", "").strip().lower()
    if v in ("1", "true", "on", "yes"):
        return True
    if v in ("0", "false", "off", "no"):
        return False
    return None


class torch_ranges:
    """Context manager: while active, phases also open torch.profiler.record_function ranges."""

    def __enter__(self):
        self._prev = _STATE.torch
        _STATE.torch = True
        _refresh()
        return self

    def __exit__(self, *exc):
        _STATE.torch = self._prev
        _refresh()
        return False


def parse_torch_range_name(text: str) -> tuple[str, int | None] | None:
    """`graphrt/TARGET_VERIFY/8` (what a phase's record_function is named) -> ("TARGET_VERIFY", 8);
    None for any other annotation."""
    if not text.startswith(TORCH_PREFIX):
        return None
    rest = text[len(TORCH_PREFIX):]
    name, _, b = rest.rpartition("/")
    if not name:
        return rest, None
    try:
        return name, int(b)
    except ValueError:
        return rest, None


def _attributes(name: str, batch_size: int):
    key = (name, batch_size)
    a = _STATE.attrs.get(key)
    if a is None:
        d = _STATE.domain
        if _STATE.category is None:
            _STATE.category = d.get_category_id("phase")
        # message: a registered string (textId in Nsight's export), payload: int64 batch size
        a = _STATE.attrs[key] = d.get_event_attributes(message=name, category=_STATE.category,
                                                       payload=int(batch_size))
    return a


class _Range:
    """One phase launch: NVTX push/pop, a record_function while torch ranges are on, and inside
    them the timer's phase (timed) if there is one. Not reentrant: one per call."""

    __slots__ = ("name", "batch_size", "timed", "rf")

    def __init__(self, name: str, batch_size: int, timed=None):
        self.name, self.batch_size, self.timed, self.rf = name, batch_size, timed, None

    def __enter__(self):
        # NVTX outermost: the timer's event records are API calls, not launches, and sit inside.
        if _STATE.nvtx:
            _STATE.push(_attributes(self.name, self.batch_size), _STATE.domain.handle)
        if _STATE.torch:
            from torch.profiler import record_function  # only while a torch profile runs

            self.rf = record_function(f"{TORCH_PREFIX}{self.name}/{self.batch_size}")
            self.rf.__enter__()
        if self.timed is not None:
            self.timed.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            if self.timed is not None:
                self.timed.__exit__(*exc)
        finally:
            if self.rf is not None:
                self.rf.__exit__(*exc)
                self.rf = None
            if _STATE.nvtx:
                _STATE.pop(_STATE.domain.handle)
        return False


class PhaseHooks:
    """What the cycle wraps around each phase launch (eager call or graph replay):

        with self.hooks.phase(TARGET_VERIFY, B):
            ...launch...

    timer: a PhaseTimer (CUDA events from a ring) or None. NVTX follows the global switch
    (GRAPHRT_NVTX / enable_nvtx, auto when a tool is attached). With no timer and ranges off,
    phase() returns a shared null context: the cost is one attribute check.
    """

    __slots__ = ("timer",)

    def __init__(self, timer=None):
        self.timer = timer

    def phase(self, name: str, batch_size: int):
        if self.timer is not None:
            return _Range(name, batch_size, self.timer.phase(name, batch_size))
        return _Range(name, batch_size) if _STATE.active else _NULL


enable_nvtx(_env_setting())
