"""Paged KV cache: a preallocated pool of fixed-size blocks per model, and the host-side block
allocator that hands blocks to request slots.

Block 0 is never given to a request. Every block-table entry that does not belong to a live
request points at it, so a padded batch row or a position past a request's reservation writes
into block 0 and never into another request's KV (the padded-rows-index-past-the-table hazard,
vLLM #43682).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphrt.errors import CapacityError, OptionError

TRASH_BLOCK = 0


@dataclass
class KVPool:
    """k[layer], v[layer]: [num_blocks, block_size, num_kv_heads, head_dim]."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    block_size: int

    @classmethod
    def allocate(cls, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device) -> KVPool:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        return cls(k, v, block_size)

    @staticmethod
    def bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class BlockAllocator:
    """Free list of block ids 1..num_blocks-1 (block 0 is the trash block)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise CapacityError(f"the KV pool needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise CapacityError(f"KV pool exhausted: need {n} blocks, {len(self._free)} free of {self.num_blocks - 1}")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


def blocks_for_budget(*, block_size: int, bytes_per_block: int, token_budget: int | None,
                      memory_fraction: float | None, device) -> int:
    """Number of blocks (trash block included) for a token budget or a fraction of free memory."""
    if token_budget is not None:
        return -(-token_budget // block_size) + 1
    if memory_fraction is None or not torch.cuda.is_available() or torch.device(device).type != "cuda":
        raise OptionError("give kv_budget_tokens, or kv_memory_fraction on a CUDA device")
    free, _ = torch.cuda.mem_get_info(device)
    return max(2, int(free * memory_fraction) // bytes_per_block)
