"""The tensor-parallel group a runtime belongs to, and the collectives its model calls.

One process per GPU (or per CPU process with gloo, for tests), launched by torchrun or by
`graphrt ... --tp N` (graphrt/parallel/launch.py). Every rank runs the same host code on the same
requests (SPMD): the sampler's result is identical on every rank, so every rank's scheduler makes
the same decisions and no request or token ever needs broadcasting; rank 0 reports.
"""

from __future__ import annotations

import datetime
import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from graphrt.errors import ConfigMismatchError, ParallelError
from graphrt.kernels.push_reduce import MAX_ROWS, PushTarget


class _OneShotAllReduce:
    """Decode-sized all-reduces through torch's symmetric memory: one kernel copies the rank's
    input into its buffer, waits for every peer's, sums all of them over NVLink loads in rank order
    (so every rank gets the same bits) and waits again before the buffer may be reused: faster than
    NCCL's ring inside a graph at decode sizes (scripts/allreduce_bench.py). Capturable: its
    barriers reset their own signals."""

    def __init__(self, group, device, dtype, numel: int):
        import torch.distributed._symmetric_memory as symm_mem

        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # older torch needs it; newer ones warn it is not
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(group.group_name)
        self.name = group.group_name
        self.buffer = symm_mem.empty(numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.name)

    def fits(self, x: torch.Tensor) -> bool:
        return (x.dtype == self.buffer.dtype and x.is_contiguous() and x.numel() <= self.buffer.numel()
                and (x.numel() * x.element_size()) % 16 == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.symm_mem.one_shot_all_reduce_copy(self.buffer[: x.numel()], x.view(-1), "sum", self.name)
        return out.view(x.shape)


def _push_target(group, rank: int, world: int, device, dtype, numel: int) -> PushTarget:
    """Collective: the push buffers of kernels/push_reduce.py (data in symmetric memory, zeroed on
    every rank before any rank may push) for products of up to numel outputs (all rows)."""
    import torch.distributed._symmetric_memory as symm_mem

    words = -(-numel // 32) * 16  # two outputs a word; every slot 128-byte aligned
    data = symm_mem.empty(2 * world * words, dtype=torch.int64, device=device)
    table = torch.tensor(symm_mem.rendezvous(data, group.group_name).buffer_ptrs, dtype=torch.int64, device=device)
    data.zero_()
    torch.cuda.synchronize(device)
    dist.barrier(group=group)
    return PushTarget(data.view(2, world, words), table, torch.zeros(words, dtype=torch.int32, device=device),
                      rank, world, dtype)


@dataclass
class TensorParallel:
    group: dist.ProcessGroup
    rank: int
    world_size: int
    one_shot: _OneShotAllReduce | None = None
    push: PushTarget | None = None  # row-parallel products of 1-16 tokens (kernels/push_reduce.py)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks (a row-parallel projection's partial products): the returned
        tensor, x itself on the NCCL path."""
        if self.one_shot is not None and self.one_shot.fits(x):
            return self.one_shot(x)
        dist.all_reduce(x, group=self.group)
        return x

    def use_symmetric_memory(self, device, dtype, numel: int, hidden: int) -> str:
        """Collective: route all-reduces of up to numel elements of dtype through symmetric memory
        (_OneShotAllReduce) where the GPUs and torch allow, and at two to four ranks in bf16/fp16 sum
        row-parallel products of up to MAX_ROWS rows of `hidden` outputs inside the GEMV's own
        launch (kernels/push_reduce.py).
        GRAPHRT_ALLREDUCE: auto (that) or nccl (every all-reduce on NCCL). Returns the path taken,
        "push + one-shot", "one-shot" (where the push does not apply) or "nccl" (with the reason)."""
        mode = os.environ.get("GRAPHRT_ALLREDUCE", "auto")
        if mode not in ("auto", "nccl"):
            raise ValueError(f"GRAPHRT_ALLREDUCE must be auto or nccl, got {mode!r}")
        if device.type != "cuda" or mode == "nccl":
            return "nccl"
        try:
            self.one_shot = _OneShotAllReduce(self.group, device, dtype, numel)
            # two outputs to an LL word; two and four ranks: the counts its GPU tests have run
            if dtype in (torch.bfloat16, torch.float16) and 2 <= self.world_size <= 4:
                self.push = _push_target(self.group, self.rank, self.world_size, device, dtype,
                                         MAX_ROWS * hidden)
        except Exception as exc:  # noqa: BLE001 - an older torch or GPUs without P2P: NCCL does it all
            self.one_shot = self.push = None
            return f"nccl ({type(exc).__name__}: {exc})"
        return self.symmetric_path

    @property
    def symmetric_path(self) -> str:
        """The decode all-reduce path once use_symmetric_memory has set up symmetric memory."""
        return "push + one-shot" if self.push is not None else "one-shot"

    def heads(self, num_heads: int, num_kv_heads: int) -> tuple[int, int, int, int]:
        """(first q head, q heads, first kv head, kv heads) of this rank. With fewer KV heads than
        ranks each KV head is replicated on world_size / num_kv_heads ranks, as vLLM does."""
        w, r = self.world_size, self.rank
        if num_heads % w:
            raise ConfigMismatchError(
                f"tensor_parallel_size {w} does not divide num_attention_heads {num_heads}")
        if num_kv_heads % w and w % num_kv_heads:
            raise ConfigMismatchError(
                f"tensor_parallel_size {w} and num_key_value_heads {num_kv_heads}: one must divide the other")
        return r * num_heads // w, num_heads // w, r * num_kv_heads // w, max(1, num_kv_heads // w)

    def agree(self, error: BaseException | None) -> None:
        """Collective: raise on every rank if any rank failed (the lowest failing rank's error, with
        its rank named), so that no rank goes on alone into a collective the others never join."""
        errors = [None] * self.world_size
        dist.all_gather_object(errors, None if error is None else f"{type(error).__name__}: {error}",
                               group=self.group)
        bad = [(r, e) for r, e in enumerate(errors) if e is not None]
        if bad:
            rank, message = bad[0]
            raise ParallelError(f"tensor-parallel rank {rank} of {self.world_size} failed: {message}") from error


@contextmanager
def rank_zero_first(tp: TensorParallel | None):
    """Rank 0 runs the block first (it writes the embedded checkpoints into the shared cache),
    the other ranks after it has finished (they find them written)."""
    if tp is not None and tp.rank:
        dist.barrier(group=tp.group)
    yield
    if tp is not None and not tp.rank:
        dist.barrier(group=tp.group)


def join_ranks(tp_size: int | None) -> TensorParallel | None:
    """The CLI's `--tp N`: this process's TensorParallel for N > 1, else None."""
    return init_tensor_parallel(tp_size) if tp_size is not None and tp_size > 1 else None


def init_tensor_parallel(size: int | None = None, *, backend: str | None = None,
                         timeout_s: float = 600.0) -> TensorParallel:
    """Join (or start) the default process group from torchrun's environment (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and return this rank's TensorParallel. NCCL when CUDA is
    available, else gloo. On CUDA the rank's device becomes cuda:LOCAL_RANK."""
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            raise RuntimeError("tensor parallelism needs one process per rank: launch with torchrun "
                               "--nproc-per-node N or `graphrt ... --tp N`")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    world = dist.get_world_size()
    if size is not None and size != world:
        raise ValueError(f"tensor_parallel_size {size} but the process group has {world} ranks")
    return TensorParallel(dist.group.WORLD, dist.get_rank(), world)
