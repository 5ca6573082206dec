"""Tensor parallelism: one process per GPU, each holding a slice of the target (graphrt/parallel/
shard.py says which), joined by torch.distributed collectives that the CUDA graphs capture."""

from graphrt.parallel.group import TensorParallel, init_tensor_parallel, join_ranks, rank_zero_first
from graphrt.parallel.shard import draft_shard_rule, shard_checkpoint, target_shard_rule

__all__ = ["TensorParallel", "draft_shard_rule", "init_tensor_parallel", "join_ranks", "rank_zero_first",
           "shard_checkpoint", "target_shard_rule"]
