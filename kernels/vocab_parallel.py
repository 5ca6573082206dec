"""Vocab-parallel shards (placeholder until the vocab-parallel sampler lands)."""

from __future__ import annotations

from graphrt.kernels.rejection_reference import RACE_CHUNK


def vocab_race_chunk(vocab_size: int, world_size: int) -> int:
    per = -(-vocab_size // world_size)
    return min(RACE_CHUNK, 1 << (per - 1).bit_length())


def vocab_shard(vocab_size: int, world_size: int, rank: int) -> tuple[int, int]:
    if vocab_size < world_size:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the {world_size} ranks")
    chunk = vocab_race_chunk(vocab_size, world_size)
    per = -(-vocab_size // world_size)
    size = -(-per // chunk) * chunk
    return min(rank * size, vocab_size), min((rank + 1) * size, vocab_size)
