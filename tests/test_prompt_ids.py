"""Prompt token ids must be integers: int() would read 1.5, True or "3" as ids 1, 1 and 3."""

import copy

import numpy as np
import pytest
import torch

from graphrt import Runtime, SamplingParams
from graphrt.errors import RequestError

PARAMS = SamplingParams(max_new_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def rt(target):
    return Runtime(target, None, max_batch_size=2, max_seq_len=32)


@pytest.mark.parametrize("prompt,bad", [
    ([1.5, 2], "element 0 is 1.5 (float)"),
    ([True, 2], "element 0 is True (bool)"),
    ([4, False], "element 1 is False (bool)"),
    (["3"], "element 0 is '3' (str)"),
    ([3, None], "element 1 is None (NoneType)"),
    ([np.float32(2.0)], "element 0 is np.float32(2.0) (float32)"),
    ([np.bool_(True)], "element 0 is np.True_ (bool)"),
    ([torch.tensor(2.0)], "element 0 is tensor(2.) (Tensor)"),
    ([torch.tensor(True)], "element 0 is tensor(True) (Tensor)"),
    (torch.tensor([1.0, 2.0]), "element 0 is 1.0 (float)"),
    (np.array([[1, 2]]), "1-D token ids, got a tensor of shape [1, 2]"),
    ("12", "got str"),
])
def test_non_integer_ids_are_refused_by_name(rt, prompt, bad):
    before = copy.deepcopy(prompt)
    for call in (lambda: rt.generate([prompt], PARAMS), lambda: rt.add_request(prompt, PARAMS)):
        with pytest.raises(RequestError, match="prompt must be") as err:
            call()
        assert bad in str(err.value)
    if isinstance(prompt, list):
        assert prompt == before and [type(t) for t in prompt] == [type(t) for t in before]
    assert not rt.has_unfinished()  # nothing was queued, and the runtime still runs:
    assert len(rt.generate([[1, 2]], PARAMS)[0].token_ids) == 4


def test_integer_scalars_and_tensors_are_accepted_and_left_alone(rt):
    want = rt.generate([[5, 6, 7]], PARAMS)[0].token_ids
    prompts = [
        [np.int64(5), np.int32(6), np.uint8(7)],
        np.array([5, 6, 7]),
        torch.tensor([5, 6, 7]),
        torch.tensor([5, 6, 7], dtype=torch.int32),
        [torch.tensor(5), 6, torch.tensor(7, dtype=torch.int16)],
        (5, 6, 7),
    ]
    snapshots = [copy.deepcopy(p) for p in prompts]
    gens = rt.generate(prompts, PARAMS)
    assert all(g.token_ids == want for g in gens)
    assert all(g.prompt_token_ids == [5, 6, 7] and all(type(t) is int for t in g.prompt_token_ids) for g in gens)
    for p, s in zip(prompts, snapshots):
        if isinstance(p, list):
            assert [type(t) for t in p] == [type(t) for t in s]
        assert [int(t) for t in p] == [int(t) for t in s]
