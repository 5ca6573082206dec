"""Phase names: NVTX range messages, profile rows and timer keys all use these strings."""

PREFILL = "PREFILL"
TARGET_VERIFY = "TARGET_VERIFY"
DRAFT_EXTEND = "DRAFT_EXTEND"
DRAFT_DECODE = "DRAFT_DECODE"
TARGET_DECODE = "TARGET_DECODE"

ALL_PHASES = (PREFILL, TARGET_VERIFY, DRAFT_EXTEND, DRAFT_DECODE, TARGET_DECODE)

_ORDER = {p: i for i, p in enumerate(ALL_PHASES)}


def phase_order(name: str, batch_size: int | None = None) -> tuple:
    """Sort key of a report row: cycle order of the phase (unknown names after, by name), then
    batch size (the all-batch-sizes row, None, last)."""
    return _ORDER.get(name, len(_ORDER)), name, batch_size is None, batch_size or 0
