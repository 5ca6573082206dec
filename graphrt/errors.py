"""graphrt's exception types.

Every error graphrt raises on bad input derives from GraphrtError, so an embedding engine can catch
one type. The ValueError bases let callers that already catch ValueError keep working.
"""

from __future__ import annotations


class GraphrtError(Exception):
    """Base class of every error graphrt raises deliberately."""


class CheckpointError(GraphrtError, ValueError):
    """A checkpoint folder cannot be used: missing/corrupt file, bad config field, bad tensor.

    The message always names the file (config.json, the shard, the .bin) and the field or tensor key.
    """


class ConfigMismatchError(CheckpointError):
    """A draft does not fit its target (vocab size, hidden size, EAGLE-3 fc width, d2t range).

    The message names the field that disagrees and both values.
    """


class OptionError(GraphrtError, ValueError):
    """A Runtime or command-line option is out of its range or conflicts with another.

    The message names the option and the value given.
    """


class CapacityError(GraphrtError):
    """A request does not fit the runtime's fixed budget (KV slots, sequence length, batch buckets)."""


class RequestError(GraphrtError, ValueError):
    """A request is malformed (bad sampling parameter, empty prompt, token id out of range)."""


class UnknownRequestError(RequestError, KeyError):
    """A request id the runtime does not hold: never issued, or its Generation already popped.
    Also a KeyError, what a lookup by id raised before."""

    def __str__(self) -> str:  # KeyError's would print the message's repr
        return str(self.args[0]) if self.args else ""


class ParallelError(GraphrtError, RuntimeError):
    """A tensor-parallel rank failed (at load, say). Raised on every rank with the same message,
    which names the failing rank and its error, so that no rank waits forever in a collective."""


__all__ = ["GraphrtError", "CheckpointError", "ConfigMismatchError", "CapacityError", "ParallelError",
           "RequestError"]
