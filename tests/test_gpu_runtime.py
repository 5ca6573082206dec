"""The runtime on CUDA with the Triton kernels: same invariants as on the CPU."""

import pytest
import torch

from graphrt import Runtime, SamplingParams
from graphrt.checkpoint import load_checkpoint
from tests.helpers import draft_dir, tiny_dir

pytestmark = pytest.mark.gpu


def _load(path):
    return load_checkpoint(path, dtype=torch.float32, device="cuda")


@pytest.mark.parametrize("kind", ["self", "lm", "eagle", "eagle3"])
def test_greedy_spec_equals_plain_on_cuda(kind):
    target = _load(tiny_dir())
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (int(n),), generator=g).tolist() for n in (3, 11, 7, 19, 5)]
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in (9, 30, 4, 22, 15)]
    plain = Runtime(target, None, device="cuda", max_batch_size=8, max_seq_len=64).generate(prompts, params)
    for K in (1, 3, 5):
        rt = Runtime(target, _load(draft_dir(kind)), num_draft_tokens=K, device="cuda", max_batch_size=8,
                     max_seq_len=64)
        spec = rt.generate(prompts, params)
        assert [s.token_ids for s in spec] == [p.token_ids for p in plain], (kind, K)


def test_seeded_request_same_on_cuda_and_cpu_batching():
    target = _load(tiny_dir())
    sp = SamplingParams(max_new_tokens=24, temperature=0.9, seed=77, ignore_eos=True)
    rt = Runtime(target, _load(draft_dir("self")), device="cuda", max_batch_size=8, max_seq_len=64)
    alone = rt.generate([[3, 4, 5]], sp)[0].token_ids
    mixed = rt.generate([[9, 9], [3, 4, 5], [1]], [SamplingParams(max_new_tokens=5, temperature=1.0), sp,
                                                    SamplingParams(max_new_tokens=40, ignore_eos=True)])
    assert mixed[1].token_ids == alone
