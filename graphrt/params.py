"""What a caller asks for (SamplingParams) and what it gets back (Generation)."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import numpy as np
import torch

from graphrt.errors import RequestError

GREEDY_BELOW = 1e-5  # temperatures under this decode greedily


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters.

    temperature 0 (or below 1e-5) is greedy; > 0 samples exactly from the temperature-scaled target distribution
    (speculative decoding never changes the distribution). `seed` makes a sampled request
    reproducible whatever else shares its batch; None draws a seed at admission.
    top_k (0: off), top_p (1: off), min_p (0: off) filter a sampled request's distribution after
    the temperature, in that order; greedy requests ignore them (README, "Python API").
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    seed: int | None = None
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        stops = tuple(token_ids(self.stop_token_ids, "SamplingParams.stop_token_ids"))
        if any(t < 0 for t in stops):
            raise RequestError(f"SamplingParams.stop_token_ids must be token ids >= 0, got {stops}")
        object.__setattr__(self, "stop_token_ids", stops)
        self.validate()
        if self.temperature < GREEDY_BELOW:
            # 1/T of a tiny temperature overflows fp32, and such a distribution is a point mass
            # on the argmax anyway: decode greedily (vLLM draws the line at the same place).
            object.__setattr__(self, "temperature", 0.0)

    def validate(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise RequestError(f"SamplingParams.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        t = self.temperature
        if not isinstance(t, (int, float)) or math.isnan(t) or math.isinf(t) or t < 0:
            raise RequestError(f"SamplingParams.temperature must be a finite number >= 0, got {t!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**63):
            raise RequestError(f"SamplingParams.seed must be a 64-bit int or None, got {self.seed!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or not 0 <= self.top_k < 2**31:
            raise RequestError(f"SamplingParams.top_k must be an int >= 0 (0: off), got {self.top_k!r}")
        if not _number(self.top_p) or not 0 < self.top_p <= 1:
            raise RequestError(f"SamplingParams.top_p must be a number in (0, 1] (1: off), got {self.top_p!r}")
        if not _number(self.min_p) or not 0 <= self.min_p < 1:
            raise RequestError(f"SamplingParams.min_p must be a number in [0, 1) (0: off), got {self.min_p!r}")

    @property
    def filters(self) -> bool:
        """Whether top_k, top_p or min_p is on."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


def token_ids(ids, what: str) -> list[int]:
    """ids as a new list of Python ints. Elements must be integers (int, numpy or torch integer
    scalars; a 1-D integer array or tensor as a whole): int() would read 1.5, True or "3" as token
    ids 1, 1 and 3. Anything else is a RequestError that names `what` and the element."""
    if isinstance(ids, (torch.Tensor, np.ndarray)):
        if ids.ndim != 1:
            raise RequestError(f"{what} must be 1-D token ids, got a tensor of shape {list(ids.shape)}")
        ids = ids.tolist()  # python ints, floats or bools: checked below like a list
    elif isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise RequestError(f"{what} must be a list of token ids, got {type(ids).__name__}")
    out = []
    for i, t in enumerate(ids):
        is_bool = isinstance(t, (bool, np.bool_)) or (isinstance(t, torch.Tensor) and t.dtype == torch.bool)
        try:
            if is_bool:
                raise TypeError
            out.append(operator.index(t))  # ints, numpy integers, 0-d integer tensors; not floats or strings
        except TypeError:
            raise RequestError(
                f"{what} must be a list of token ids: element {i} is {t!r} ({type(t).__name__}), "
                "not an integer") from None
    return out


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


@dataclass
class Generation:
    """The result of one request."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (a stop or EOS token) | "length" | "abort" (Runtime.abort)
    num_cycles: int = 0  # speculative cycles (or plain decode steps) this request took part in
    num_draft_tokens: int = 0  # drafts proposed to the target
    num_accepted_tokens: int = 0  # drafts the target accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per cycle (accepted drafts + 1), the usual speculative-decoding figure."""
        decoded = len(self.token_ids) - 1  # the first token comes from prefill
        return decoded / self.num_cycles if self.num_cycles else 0.0


@dataclass(frozen=True)
class RuntimeStats:
    """A snapshot of a Runtime (Runtime.stats()), from counts the host keeps: reading one never
    waits for the GPU. Counts run from the Runtime's start."""

    waiting: int  # requests queued for a slot and their KV blocks (or part way through a chunked prefill)
    running: int  # requests being decoded
    free_slots: int
    kv_blocks_free: int
    kv_blocks_total: int  # blocks requests can hold (the trash block excluded)
    cycles: int  # decode cycles launched (speculative cycles, or plain steps)
    prefills: int  # prefill forwards (each admits one or more requests)
    prompt_tokens: int  # prompt tokens prefilled (computed)
    cached_prompt_tokens: int  # prompt tokens whose KV came from cached blocks instead (prefix caching)
    generated_tokens: int  # tokens given to requests, each request's first (from its prefill) included
    draft_tokens: int  # drafts proposed to the target, in cycles whose tokens a request kept
    accepted_tokens: int  # of those, the drafts the target accepted
    host_seconds: float  # host time in step() outside waiting for the GPU

    @property
    def kv_usage(self) -> float:
        """The fraction of KV blocks that requests hold."""
        return 1.0 - self.kv_blocks_free / self.kv_blocks_total

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

