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

With everything off a phase call costs a fraction of a microsecond (one attribute test); NVTX on
adds a push and pop through the nvtx C extension, and an attached tool its own cost on top.
`python -m graphrt.profiling.nvtx_ranges` measures the per-call cost.
"""

from __future__ import annotations

import os
from contextlib import nullcontext

DOMAIN = "graphrt"
TORCH_PREFIX = "graphrt/"
_NULL = nullcontext()


class _State:
    __slots__ = ("nvtx", "torch", "active", "requested", "domain", "attrs", "category", "push", "pop")

    def __init__(self):
        self.nvtx = False  # ranges are emitted (requested and a real domain exists)
        self.torch = False  # record_function ranges are opened
        self.active = False  # nvtx or torch: the one check on the hot path
        self.requested: bool | None = None  # None: auto (on when a tool is attached)
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


def _apply(requested: bool | None) -> None:
    _STATE.requested = requested
    want = requested if requested is not None else True  # auto: on iff a tool gave a real domain
    _STATE.nvtx = bool(want) and _domain() is not None
    _refresh()


def enable_nvtx(on: bool | None = True) -> bool:
    """Switch NVTX phase ranges on (True), off (False) or to auto (None: on when a tool is
    attached). Returns whether ranges are now emitted."""
    _apply(on)
    return _STATE.nvtx


def disable_nvtx() -> None:
    _apply(False)


def nvtx_enabled() -> bool:
    return _STATE.nvtx


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


def torch_range_name(name: str, batch_size: int) -> str:
    return f"{TORCH_PREFIX}{name}/{batch_size}"


def parse_torch_range_name(text: str) -> tuple[str, int | None] | None:
    """`graphrt/TARGET_VERIFY/8` -> ("TARGET_VERIFY", 8); None for any other annotation."""
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
    """NVTX push/pop (+ record_function when torch ranges are on). Not reentrant: one per call."""

    __slots__ = ("name", "batch_size", "rf")

    def __init__(self, name: str, batch_size: int):
        self.name, self.batch_size, self.rf = name, batch_size, None

    def __enter__(self):
        if _STATE.nvtx:
            _STATE.push(_attributes(self.name, self.batch_size), _STATE.domain.handle)
        if _STATE.torch:
            from torch.profiler import record_function  # only while a torch profile runs

            self.rf = record_function(torch_range_name(self.name, self.batch_size))
            self.rf.__enter__()
        return self

    def __exit__(self, *exc):
        if self.rf is not None:
            self.rf.__exit__(*exc)
            self.rf = None
        if _STATE.nvtx:
            _STATE.pop(_STATE.domain.handle)
        return False


def phase_range(name: str, batch_size: int):
    """Context manager: the NVTX range of one phase launch (nothing when ranges are off)."""
    if not _STATE.active:
        return _NULL
    return _Range(name, batch_size)


class _TimedRange:
    __slots__ = ("rng", "timed")

    def __init__(self, rng, timed):
        self.rng, self.timed = rng, timed

    def __enter__(self):
        # NVTX outermost: the timer's event records are API calls, not launches, and sit inside.
        if self.rng is not None:
            self.rng.__enter__()
        self.timed.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            self.timed.__exit__(*exc)
        finally:
            if self.rng is not None:
                self.rng.__exit__(*exc)
        return False


class PhaseHooks:
    """What the cycle wraps around each phase launch (eager call or graph replay):

        with self.hooks.phase(TARGET_VERIFY, B):
            ...launch...

    timer: a PhaseTimer (CUDA events from a ring) or None. nvtx: None follows the global switch
    (GRAPHRT_NVTX / enable_nvtx, auto when a tool is attached); True or False set it globally
    now. With no timer and ranges off, phase() returns a shared null context: the cost is one
    attribute check.
    """

    __slots__ = ("timer",)

    def __init__(self, timer=None, nvtx: bool | None = None):
        self.timer = timer
        if nvtx is not None:
            _apply(nvtx)

    def phase(self, name: str, batch_size: int):
        timer = self.timer
        if timer is None:
            if not _STATE.active:
                return _NULL
            return _Range(name, batch_size)
        return _TimedRange(_Range(name, batch_size) if _STATE.active else None, timer.phase(name, batch_size))


_apply(_env_setting())


def measure_overhead(number: int = 200_000) -> dict[str, float]:
    """Per-call cost in microseconds of `with hooks.phase(...)` with ranges off and on, and of
    phase_range() off, net of the harness (a function running `with nullcontext(): pass`). "on"
    uses the real nvtx extension when a domain exists; without a tool it measures the push/pop
    path against the nvtx extension's no-op entry points."""
    import timeit

    def t(fn):
        return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6

    saved = (_STATE.requested, _STATE.nvtx, _STATE.torch, _STATE.domain)
    hooks = PhaseHooks()
    out = {}
    try:
        _STATE.torch = False
        disable_nvtx()
        base = t(_baseline)
        out["baseline_us"] = base
        out["hooks_off_us"] = t(lambda: _enter_exit(hooks)) - base
        out["phase_range_off_us"] = t(_enter_exit_range) - base
        if _domain() is None:
            try:
                import nvtx
            except ImportError:
                return out
            # No tool attached: build a real Domain object anyway, so the measurement includes the
            # attribute lookup, the extension call and the pop (each a no-op inside libnvtx).
            d = object.__new__(nvtx._lib.Domain)
            d.handle = nvtx._lib.lib.DomainHandle(DOMAIN)
            nvtx._lib.Domain.__init__(d, DOMAIN)
            _STATE.domain = d
            _STATE.push, _STATE.pop = nvtx._lib.push_range, nvtx._lib.pop_range
        _STATE.attrs.clear()
        _STATE.category = None
        _STATE.nvtx = True
        _refresh()
        out["hooks_nvtx_on_us"] = t(lambda: _enter_exit(hooks)) - base
    finally:
        _STATE.requested, _STATE.nvtx, _STATE.torch, _STATE.domain = saved
        _STATE.attrs.clear()
        _STATE.category = None
        _refresh()
    return out


def _baseline():
    with _NULL:
        pass


def _enter_exit(hooks):
    with hooks.phase("TARGET_VERIFY", 8):
        pass


def _enter_exit_range():
    with phase_range("TARGET_VERIFY", 8):
        pass


if __name__ == "__main__":
    for k, v in measure_overhead().items():
        print(f"{k:>20}: {v:.3f} us")
