"""Hypothesis fuzzing of the Triton kernels against their PyTorch references.

On the CPU the Triton kernels run under TRITON_INTERPRET=1 (tests/conftest.py) at small sizes
(V <= 300, B <= 4, K <= 4), with few examples: the interpreter costs ~0.1-1 s per call. The `gpu`
variants repeat every property at real sizes (V = 128256, B up to 64) with more examples.

Each example is a small *spec* (shapes, dtype, a generator seed, which hazards to plant, launch
overrides); the tensors are built from it deterministically, so the falsifying example hypothesis
prints is enough to rebuild the failing input (`build_*(spec)`). Each test's hypothesis seed comes
from the run's base seed (tests/seeds.py, printed at the end of the run), so `GRAPHRT_TEST_SEED=<base>`
replays a run's examples too.

Properties, beyond "Triton == reference":
  argmax            identical indices and value bits; index in [0, V) for NaN / -inf rows.
  rejection_sample  identical token_ids, num_emitted and acceptance counts, logprobs close (-inf
                    equal); every emitted id in [0, V), -1 and 0.0 after the last; a logprob is -inf
                    only on a dead row (p = 0 never emitted); inputs bit-identical afterwards; every
                    element of a garbage-filled `out` rewritten.
  paged_attention   close to the reference; no NaN although every non-live cache slot holds NaN and
                    the table past the live blocks holds -1 / huge / foreign ids (vLLM #43682);
                    rows with a negative position exactly zero.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from graphrt.kernels.argmax import argmax_reference, argmax_triton
from graphrt.kernels.attention import paged_attention_reference, paged_attention_triton
from graphrt.kernels.rejection import launch_config, rejection_sample_reference, rejection_sample_triton
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from tests.seeds import named_seed

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_FAST = dict(deadline=None, database=None, print_blob=True, derandomize=False,
             suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# NaN / inf inputs make numpy warn inside the interpreter; they are the point of these tests.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def cpu_settings(n: int):
    return settings(max_examples=n, **_FAST)


def gpu_settings(n: int):
    return settings(max_examples=n, **_FAST)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.contiguous(), b.contiguous()
    if a.numel() == 0 or b.numel() == 0:  # an empty tensor may keep a zero stride, which view() refuses
        return a.dtype == b.dtype and a.shape == b.shape
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# Row patterns planted into logits. "normal" rows are random; the others are the hazards the peers
# got wrong: NaN (vLLM #20531), all -inf / dead rows, +inf, ties, one live entry, huge magnitudes.
ROW_KINDS = ["normal", "normal", "normal", "ties", "all_nan", "all_ninf", "one_pinf", "two_pinf",
             "one_live", "scattered_nan", "uniform", "huge"]


def _fill_row(row: torch.Tensor, kind: str, gen: torch.Generator) -> None:
    """row: [V] fp32, edited in place."""
    v = row.numel()

    def idx(n=1):
        return torch.randint(0, v, (n,), generator=gen)

    if kind == "ties":
        row.copy_(torch.randint(-2, 3, (v,), generator=gen).float())
    elif kind == "all_nan":
        row.fill_(float("nan"))
    elif kind == "all_ninf":
        row.fill_(float("-inf"))
        if v > 1:
            row[idx()] = float("nan")
    elif kind == "one_pinf":
        row[idx()] = float("inf")
    elif kind == "two_pinf":
        row[idx(2)] = float("inf")
    elif kind == "one_live":
        i = idx()
        row.fill_(float("-inf"))
        row[i] = 3.0
    elif kind == "scattered_nan":
        row[torch.rand(v, generator=gen) < 0.3] = float("nan")
        row[torch.rand(v, generator=gen) < 0.1] = float("-inf")
    elif kind == "uniform":
        row.fill_(1.25)
    elif kind == "huge":
        row.mul_(1e37)  # overflows to +/-inf in fp16; x * inv_t overflows fp32 at small temperatures


# ---------------------------------------------------------------------------------------------
# argmax
# ---------------------------------------------------------------------------------------------


@st.composite
def argmax_specs(draw, max_b=4, max_v=300, real=False):
    b = draw(st.integers(1, max_b))
    v = draw(st.sampled_from([128256, 128000, 32000])) if real else draw(st.integers(1, max_v))
    return dict(
        b=b, v=v, dtype=draw(st.sampled_from(DTYPES)), seed=draw(st.integers(0, 2**32 - 1)),
        rows=draw(st.lists(st.sampled_from(ROW_KINDS), min_size=b, max_size=b)),
        # block_v/num_splits small enough that these V split into several chunks; None = heuristics
        block_v=None if real else draw(st.sampled_from([None, 16, 32, 64, 128])),
        num_splits=draw(st.sampled_from([None, 1, 2, 3, 7])),
        fused=draw(st.sampled_from([None, False, True])),
        strided=draw(st.booleans()),  # rows of a wider buffer (row stride > V)
    )


def build_argmax(spec, device="cpu") -> torch.Tensor:
    gen = _gen(spec["seed"])
    b, v = spec["b"], spec["v"]
    x = torch.randn(b, v + 3 if spec["strided"] else v, generator=gen) * 4
    for i, kind in enumerate(spec["rows"]):
        _fill_row(x[i, :v], kind, gen)
    x = x.to(spec["dtype"]).to(device)
    return x[:, :v]


def check_argmax(spec, device="cpu"):
    x = build_argmax(spec, device)
    before = x.clone()
    ref_v, ref_i = argmax_reference(x)
    kw = {k: spec[k] for k in ("block_v", "num_splits", "fused") if spec[k] is not None}
    got_v, got_i = argmax_triton(x, **kw)
    assert torch.equal(got_i, ref_i), (got_i, ref_i)
    assert same_bits(got_v, ref_v), (got_v, ref_v)
    assert ((got_i >= 0) & (got_i < spec["v"])).all()
    assert same_bits(x, before), "input modified"


@cpu_settings(80)
@given(argmax_specs())
@seed(named_seed("test_fuzz_argmax"))
def test_fuzz_argmax(spec):
    check_argmax(spec)


@pytest.mark.gpu
@gpu_settings(300)
@given(argmax_specs(max_b=64, real=True))
@seed(named_seed("test_fuzz_argmax_gpu"))
def test_fuzz_argmax_gpu(spec):
    check_argmax(spec, "cuda")


# ---------------------------------------------------------------------------------------------
# rejection_sample
# ---------------------------------------------------------------------------------------------

TEMPS = [0.0, 0.0, -0.0, float("nan"), 1e-40, 1e-30, 1e-6, 0.7, 1.0, 1.0, 1.3, 100.0]
INVALID_DRAFTS = [-1, -2, "V", "V+1", 2**31 - 1, -(2**31), 2**40, INT64_MAX, INT64_MIN]
SEEDS = st.one_of(st.integers(INT64_MIN, INT64_MAX), st.sampled_from([0, -1, INT64_MIN, INT64_MAX]))
POSITIONS = st.one_of(st.integers(0, 2**40), st.sampled_from([0, 2**31 - 1, 2**32, INT64_MAX - 8]))


@st.composite
def rejection_specs(draw, max_b=4, max_k=4, max_v=300, real=False):
    b = draw(st.integers(1, max_b))
    k = draw(st.integers(0, max_k))
    v = draw(st.sampled_from([128256, 32000, 1000])) if real else draw(st.integers(1, max_v))
    mode = draw(st.sampled_from(["greedy", "onehot", "onehot", "fullq"]))
    temps = [0.0] * b if mode == "greedy" else draw(st.lists(st.sampled_from(TEMPS), min_size=b, max_size=b))
    return dict(
        b=b, k=k, v=v, mode=mode, temps=temps,
        dtype=draw(st.sampled_from(DTYPES)), seed=draw(st.integers(0, 2**32 - 1)),
        rows=draw(st.lists(st.sampled_from(ROW_KINDS), min_size=b * (k + 1), max_size=b * (k + 1))),
        # where each draft comes from: the row's argmax (accepted when greedy), a random id, or junk
        drafts=draw(st.lists(st.sampled_from(["argmax", "argmax", "random", "invalid"]),
                             min_size=b * k, max_size=b * k)),
        invalid=draw(st.lists(st.sampled_from(INVALID_DRAFTS), min_size=b * k, max_size=b * k)),
        draft_dtype=draw(st.sampled_from([torch.int64, torch.int64, torch.int32])),
        # full q: draft logits near the target's, equal to it (all-zero residual), or random
        q_kind=draw(st.sampled_from(["near", "equal", "random", "hazard"])),
        ragged=draw(st.sampled_from([None, torch.int64, torch.int32])),
        nd=draw(st.lists(st.integers(0, k), min_size=b, max_size=b)),
        seeds=draw(st.lists(SEEDS, min_size=b, max_size=b)),
        positions=draw(st.lists(POSITIONS, min_size=b, max_size=b)),
        counts=draw(st.booleans()),
        out=draw(st.booleans()),  # preallocated out buffers full of garbage
        block_v=None if real else draw(st.sampled_from([None, 32, 64, 128])),
        num_splits=draw(st.sampled_from([None, 2, 3])),
        fuse_race=draw(st.sampled_from([None, True, False])),
        # the two-level race's chunk (one-hot): many chunks at small V, or the default
        race_chunk=None if real else draw(st.sampled_from([None, 8, 16, 64, 256])),
        # top_k / top_p / min_p per request (None: no filter tensors at all); 0 / 1 / 0 are off
        filters=draw(st.sampled_from([None, None, "some"])),
        # the filters' candidate buffer: the default, two groups (often overflowing), none (whole rows)
        filter_cap=draw(st.sampled_from([None, 32, 0])),
        top_k=draw(st.lists(st.sampled_from([0, 1, 2, 5, 40, 2**20]), min_size=b, max_size=b)),
        top_p=draw(st.lists(st.sampled_from([1.0, 0.9, 0.5, 1e-6]), min_size=b, max_size=b)),
        min_p=draw(st.lists(st.sampled_from([0.0, 0.05, 0.5, 0.999]), min_size=b, max_size=b)),
    )


def build_rejection(spec, device="cpu"):
    gen = _gen(spec["seed"])
    b, k, v = spec["b"], spec["k"], spec["v"]
    raw = torch.randn(b, k + 1, v, generator=gen) * 3
    for i, kind in enumerate(spec["rows"]):
        _fill_row(raw[i // (k + 1), i % (k + 1)], kind, gen)
    target = raw.to(spec["dtype"])
    clean = torch.where(torch.isnan(target.float()), float("-inf"), target.float())
    drafts = torch.zeros(b, k, dtype=torch.int64)
    for i, how in enumerate(spec["drafts"]):
        bi, j = divmod(i, k)
        if how == "argmax":
            drafts[bi, j] = int(clean[bi, j].argmax())
        elif how == "random":
            drafts[bi, j] = int(torch.randint(0, v, (1,), generator=gen))
        else:
            bad = spec["invalid"][i]
            bad = v if bad == "V" else v + 1 if bad == "V+1" else bad
            if spec["draft_dtype"] == torch.int32:
                bad = max(-(2**31), min(2**31 - 1, bad)) if bad not in (v, v + 1) else bad
            drafts[bi, j] = bad
    drafts = drafts.to(spec["draft_dtype"])
    draft_logits = None
    if spec["mode"] == "fullq":
        qk = spec["q_kind"]
        q = raw[:, :k].clone()
        if qk == "near":
            q = q + torch.randn(b, k, v, generator=gen)
        elif qk == "random":
            q = torch.randn(b, k, v, generator=gen) * 3
        elif qk == "hazard" and k > 0:
            q[0, 0] = float("nan")
            q[-1, -1, :] = float("-inf")
        draft_logits = q.to(spec["dtype"])
    args = dict(
        target_logits=target,
        draft_token_ids=drafts,
        temperature=torch.tensor(spec["temps"], dtype=torch.float32),
        seed=torch.tensor(spec["seeds"], dtype=torch.int64),
        position=torch.tensor(spec["positions"], dtype=torch.int64),
        draft_logits=draft_logits,
        num_draft_tokens=None if spec["ragged"] is None else torch.tensor(spec["nd"], dtype=spec["ragged"]),
    )
    if spec.get("filters"):
        args.update(top_k=torch.tensor(spec["top_k"]), top_p=torch.tensor(spec["top_p"], dtype=torch.float32),
                    min_p=torch.tensor(spec["min_p"], dtype=torch.float32))
    return {name: (t.to(device) if isinstance(t, torch.Tensor) else t) for name, t in args.items()}


def check_rejection_output(res, args):
    """The output contract, whatever the input."""
    target = args["target_logits"]
    b, r, v = target.shape
    nd = args["num_draft_tokens"]
    kb = torch.full((b,), r - 1) if nd is None else nd.cpu().long()
    n = res.num_emitted.cpu().long()
    tok, lp = res.token_ids.cpu(), res.logprobs.cpu()
    assert res.num_emitted.dtype == torch.int32 and tok.dtype == torch.int64 and lp.dtype == torch.float32
    assert ((n >= 1) & (n <= kb + 1)).all(), (n, kb)
    emitted = torch.arange(r)[None, :] < n[:, None]
    assert ((tok >= 0) & (tok < v))[emitted].all(), tok
    assert (tok[~emitted] == -1).all(), tok
    assert (lp[~emitted] == 0).all(), lp
    assert not torch.isnan(lp).any() and not (lp == float("inf")).any(), lp
    # p = 0 is never emitted: a -inf logprob only where the row has nothing above -inf once
    # scaled by 1/temperature (a dead row; 1/t overflows to inf for t < ~3e-39, which kills every
    # row whose maximum is <= 0: module docstring of kernels/rejection.py).
    t = args["temperature"].cpu()
    inv_t = torch.where(t > 0, 1.0 / torch.where(t > 0, t, 1.0), 1.0)
    scaled = target.float().cpu() * inv_t[:, None, None]
    dead = scaled.nan_to_num(nan=float("-inf"), posinf=3e38, neginf=float("-inf")).amax(-1) == float("-inf")  # [b, r]
    assert ((lp == float("-inf")) == (dead & emitted)).all(), (lp, dead)
    # accepted drafts are the drafts
    drafts = args["draft_token_ids"].cpu().long()
    for i in range(b):
        m = int(n[i]) - 1
        assert torch.equal(tok[i, :m], drafts[i, :m]), (i, tok[i], drafts[i])


def check_rejection(spec, device="cpu"):
    args = build_rejection(spec, device)
    before = {name: t.clone() for name, t in args.items() if isinstance(t, torch.Tensor)}
    k, b, r = spec["k"], spec["b"], spec["k"] + 1
    counts_ref = torch.arange(k, dtype=torch.int64, device=device) if spec["counts"] else None
    counts_tri = counts_ref.clone() if spec["counts"] else None
    chunk = {} if spec["race_chunk"] is None else {"race_chunk": spec["race_chunk"]}
    ref = rejection_sample_reference(**args, acceptance_counts=counts_ref, **chunk)
    check_rejection_output(ref, args)
    out = None
    if spec["out"]:
        out = (torch.full((b, r), 123456, dtype=torch.int64, device=device),
               torch.full((b,), 99, dtype=torch.int32, device=device),
               torch.full((b, r), float("nan"), device=device))
    kw = {name: spec[name] for name in ("block_v", "num_splits", "fuse_race", "filter_cap")
          if spec.get(name) is not None}
    if "block_v" in kw:  # small row tiles shrink the race's with them
        kw["race_block_v"] = kw["block_v"]
    config = dataclasses.replace(launch_config(b, k, spec["mode"] == "fullq" and k > 0), **kw)
    got = rejection_sample_triton(**args, acceptance_counts=counts_tri, out=out, config=config, **chunk)
    if out is not None:
        assert got.token_ids is out[0] and got.num_emitted is out[1] and got.logprobs is out[2]
    assert torch.equal(got.token_ids, ref.token_ids), (got.token_ids, ref.token_ids)
    assert torch.equal(got.num_emitted, ref.num_emitted), (got.num_emitted, ref.num_emitted)
    torch.testing.assert_close(got.logprobs, ref.logprobs, rtol=1e-5, atol=1e-5, equal_nan=False)
    if spec["counts"]:
        assert torch.equal(counts_tri, counts_ref), (counts_tri, counts_ref)
    check_rejection_output(got, args)
    for name, t in before.items():
        assert same_bits(args[name], t), f"{name} modified"


@cpu_settings(30)
@given(rejection_specs(max_v=160))  # the interpreter's cost grows with V; 160 still splits into many tiles
@seed(named_seed("test_fuzz_rejection_sample"))
def test_fuzz_rejection_sample(spec):
    check_rejection(spec)


@pytest.mark.gpu
@gpu_settings(300)
@given(rejection_specs(max_b=64, max_k=4, real=True))
@seed(named_seed("test_fuzz_rejection_sample_gpu"))
def test_fuzz_rejection_sample_gpu(spec):
    check_rejection(spec, "cuda")


# ---------------------------------------------------------------------------------------------
# paged attention
# ---------------------------------------------------------------------------------------------

ATTN_TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}
GARBAGE = ["-1", "int32_max", "int32_min", "foreign", "poisoned", "zero"]


@st.composite
def attention_specs(draw, max_b=4, max_len=40, real=False):
    b = draw(st.integers(1, max_b))
    query_len = draw(st.sampled_from([1, 1, 2, 4, 5])) if not real else draw(st.sampled_from([1, 4, 6]))
    return dict(
        b=b, query_len=query_len,
        hkv=draw(st.sampled_from([1, 2] if not real else [8])),
        group=draw(st.sampled_from([1, 2, 4])),
        head_dim=draw(st.sampled_from([16, 24, 32] if not real else [64, 128])),
        page=draw(st.sampled_from([1, 4, 8, 16] if not real else [16, 32])),
        dtype=draw(st.sampled_from(DTYPES)),
        seed=draw(st.integers(0, 2**32 - 1)),
        # lengths below query_len give padded rows (negative positions); 0 = an empty request
        seq_lens=draw(st.lists(st.integers(0, max_len), min_size=b, max_size=b)),
        extra_cols=draw(st.integers(0, 3)),
        garbage=draw(st.lists(st.sampled_from(GARBAGE), min_size=1, max_size=4)),
        num_splits=draw(st.sampled_from([None, 1, 2, 3])),
        block_n=None if real else draw(st.sampled_from([None, 16])),
        spare=draw(st.integers(1, 3)),
    )


def build_attention(spec, device="cpu"):
    """Shuffled block ids, NaN in every slot that is not a live KV position, garbage in the table
    past each request's live blocks."""
    gen = _gen(spec["seed"])
    page, hkv, d, dtype = spec["page"], spec["hkv"], spec["head_dim"], spec["dtype"]
    lens = spec["seq_lens"]
    live = [-(-s // page) for s in lens]
    num_blocks = sum(live) + spec["spare"]
    width = max(live + [1]) + spec["extra_cols"]
    perm = torch.randperm(num_blocks, generator=gen)
    k_cache = torch.full((num_blocks, page, hkv, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    tables = torch.empty(len(lens), width, dtype=torch.int32)
    used = 0
    for i, s in enumerate(lens):
        ids = perm[used: used + live[i]]
        used += live[i]
        tables[i, : live[i]] = ids.to(torch.int32)
        for j in range(live[i], width):
            g = spec["garbage"][(i + j) % len(spec["garbage"])]
            tables[i, j] = {"-1": -1, "int32_max": 2**31 - 1, "int32_min": -(2**31), "zero": 0,
                            "foreign": int(perm[0]), "poisoned": int(perm[-1])}[g]
        if s:
            pos = torch.arange(s)
            blk = ids[pos // page]
            k_cache[blk, pos % page] = torch.randn(s, hkv, d, generator=gen).to(dtype)
            v_cache[blk, pos % page] = torch.randn(s, hkv, d, generator=gen).to(dtype)
    hq = hkv * spec["group"]
    query = torch.randn(len(lens) * spec["query_len"], hq, d, generator=gen).to(dtype)
    seq = torch.tensor(lens, dtype=torch.int32)
    return [t.to(device) for t in (query, k_cache, v_cache, tables, seq)]


def check_attention(spec, device="cpu"):
    q, kc, vc, bt, sl = build_attention(spec, device)
    before = [t.clone() for t in (q, kc, vc, bt, sl)]
    ql, scale = spec["query_len"], spec["head_dim"] ** -0.5
    ref = paged_attention_reference(q, kc, vc, bt, sl, query_len=ql, scale=scale)
    got = paged_attention_triton(q, kc, vc, bt, sl, query_len=ql, scale=scale, num_splits=spec["num_splits"],
                                 block_n=spec["block_n"])
    assert got.shape == q.shape and got.dtype == q.dtype
    assert not torch.isnan(ref).any(), "reference read a dead slot"
    assert not torch.isnan(got).any(), "Triton read a dead slot (table entry past the live length?)"
    atol, rtol = ATTN_TOL[spec["dtype"]]
    torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=rtol)
    for i, s in enumerate(spec["seq_lens"]):
        for t in range(ql):
            if s - ql + t < 0:  # padded row
                assert (got[i * ql + t] == 0).all(), f"row {i}/{t} with a negative position is not zero"
    for a, b in zip((q, kc, vc, bt, sl), before):
        assert same_bits(a, b), "input modified"


@cpu_settings(60)
@given(attention_specs())
@seed(named_seed("test_fuzz_paged_attention"))
def test_fuzz_paged_attention(spec):
    check_attention(spec)


@pytest.mark.gpu
@gpu_settings(150)
@given(attention_specs(max_b=16, max_len=2048, real=True))
@seed(named_seed("test_fuzz_paged_attention_gpu"))
def test_fuzz_paged_attention_gpu(spec):
    check_attention(spec, "cuda")
