"""Top-k, top-p and min-p in the rejection sampler: the threshold rule, Triton == reference bit for
bit, and the sampling law of the filtered distribution per position."""

import dataclasses

import pytest
import torch
import triton
from graphrt.kernels import rejection_sample
from graphrt.kernels.rejection import launch_config, rejection_sample_reference, rejection_sample_triton
from graphrt.kernels.rejection_filter import thresholds_triton
from graphrt.kernels.rejection_reference import W_BITS, thresholds_reference, weights

from tests.seeds import fresh_seed
from tests.test_rejection import (
    CHI2_ALPHA,
    assert_same_result,
    check_outputs_valid,
    chi2_pvalue,
    clone_args,
    make_inputs,
)

INF = float("inf")


def small_config(args, **fields):
    """Small tiles at small V (75: not a multiple of any of them), several splits and filter tiles."""
    b, r, _ = args["target_logits"].shape
    full_q = args.get("draft_logits") is not None and r > 1
    small = dict(block_v=16, race_block_v=16, num_splits=3, filter_block_v=32, filter_kept_block_v=16)
    return dataclasses.replace(launch_config(b, r - 1, full_q), **{**small, **fields})


def random_filters(b, v, gen, kinds=("top_k", "top_p", "min_p")):
    """Per request: each filter on or off at random, with values that bite at this V."""
    f = {}
    if "top_k" in kinds:
        f["top_k"] = torch.randint(0, 10, (b,), generator=gen) * (torch.rand(b, generator=gen) < 0.7)
    if "top_p" in kinds:
        f["top_p"] = torch.where(torch.rand(b, generator=gen) < 0.7, torch.rand(b, generator=gen) * 0.9 + 0.05,
                                 torch.ones(b))
    if "min_p" in kinds:
        f["min_p"] = torch.where(torch.rand(b, generator=gen) < 0.7, torch.rand(b, generator=gen) * 0.3,
                                 torch.zeros(b))
    return f


def tied(x: torch.Tensor) -> torch.Tensor:
    """Logits rounded to halves: many entries tie, at every threshold too."""
    return (x * 2).round() / 2


def hazard_logits(b: int, r: int, v: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Random rows, every other one tied, with a NaN entry, a dead row and a +inf entry."""
    x = torch.randn(b, r, v, generator=gen) * 3
    x[::2] = tied(x[::2])
    x[1, 1, 3], x[2, 0, :], x[4, 1, 9] = float("nan"), -INF, INF
    return x.to(dtype)


def rule_tau(raw: torch.Tensor, inv_t: float, k: int, p: float, m: float) -> float:
    """The threshold of one sampled row straight from the rule (kernels/rejection_reference.py)."""
    vals = torch.where(torch.isnan(raw), -INF, raw.float()) + 0.0
    x = (vals * torch.tensor(inv_t, dtype=torch.float32)).nan_to_num(nan=-INF).clamp(max=3.4028234663852886e38)
    w = weights(x, x.max())
    if x.max() == -INF:
        return -INF
    desc = sorted(set(vals.tolist()), reverse=True)
    tau = -INF
    if 0 < k < vals.numel():
        tau = sorted(vals.tolist(), reverse=True)[k - 1]
    if p < 1:
        total = int(w[vals >= tau].sum())
        tau = max(tau, next(c for c in desc if c >= tau and float(int(w[vals >= c].sum())) >= p * float(total)))
    if m > 0:
        tau = max(tau, min((c for c, wc in zip(vals.tolist(), w.tolist()) if float(wc) >= m * 2.0**W_BITS),
                           default=INF))
    return min(tau, desc[0])


def test_thresholds_follow_the_rule():
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    b, r, v = 8, 2, 40
    x = torch.randn(b, r, v, generator=gen) * 3
    x[::2] = tied(x[::2])
    x[1, 0, 3], x[3, 1, :] = float("nan"), -INF  # a NaN entry, a dead row
    x[5, 0, 7] = INF
    temps = torch.tensor([0.5, 1.3, 1.0, 0.7, 0.0, 2.0, 1.0, 0.9])
    f = random_filters(b, v, gen)
    tau = thresholds_reference(x, temps, f["top_k"], f["top_p"], f["min_p"])
    for i in range(b):
        for j in range(r):
            want = -INF if temps[i] <= 0 else rule_tau(
                x[i, j], float(1.0 / temps[i]), int(f["top_k"][i]), float(f["top_p"][i]), float(f["min_p"][i]))
            assert float(tau[i, j]) == want, f"seed {seed} row ({i}, {j}): {float(tau[i, j])} vs {want}"
    # the kept mass: top_p's smallest kept set still holds at least top_p of it
    assert bool((tau[temps > 0] > -INF).any())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_thresholds_triton_match_reference(dtype):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    b, r, v = 6, 2, 75
    x = hazard_logits(b, r, v, gen, dtype)
    temps = torch.tensor([1.0, 0.5, 1.3, 0.0, 1e-6, 100.0])
    for kinds in (("top_k",), ("top_p",), ("min_p",), ("top_k", "top_p", "min_p")):
        f = random_filters(b, v, gen, kinds)
        args = [f.get(name) for name in ("top_k", "top_p", "min_p")]
        ref = thresholds_reference(x, temps, *args).flatten()
        got = thresholds_triton(x, temps, *args, block_v=32, num_warps=4, pdl=0)
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), f"seed {seed} {kinds}: {got} vs {ref}"


def _filtering(f: dict, b: int, v: int) -> torch.Tensor:
    """[b] bool: which requests' filters cut anything at vocabulary size v."""
    out = torch.zeros(b, dtype=torch.bool)
    if "top_k" in f:
        out |= (f["top_k"] > 0) & (f["top_k"] < v)
    if "top_p" in f:
        out |= f["top_p"] < 1
    if "min_p" in f:
        out |= f["min_p"] > 0
    return out


def _candidates(x: torch.Tensor, temps: torch.Tensor, f: dict, cap: int, sup: int) -> list[str]:
    """Per row, which way the Triton path takes it (kernels/rejection_filter.py, mirrored here in
    torch): "candidates", "whole row" (too many candidates) or "" (filters nothing, or top_p without
    top_k); sup: groups per supergroup."""
    from graphrt.kernels.rejection_filter import GROUP

    b, r, v = x.shape
    out = []
    for i in range(b):
        k = int(f["top_k"][i]) if "top_k" in f else 0
        p = float(f["top_p"][i]) if "top_p" in f else 1.0
        m = float(f["min_p"][i]) if "min_p" in f else 0.0
        use_k = 0 < k < v
        for j in range(r):
            if not temps[i] > 0 or not (use_k or p < 1 or m > 0):
                out.append("")
                continue
            vals = torch.where(torch.isnan(x[i, j]), -INF, x[i, j].float()) + 0.0
            xs = (vals * (1.0 / temps[i])).nan_to_num(nan=-INF, neginf=-INF).clamp(max=3.4028234663852886e38)
            if xs.max() == -INF:
                out.append("candidates")  # none: a dead row
                continue
            gmax = torch.stack([vals[g:g + GROUP].max() for g in range(0, v, GROUP)])
            smax = torch.stack([gmax[s:s + sup].max() for s in range(0, len(gmax), sup)])
            if use_k:  # the groups from the k-th largest supergroup max up (else group max, else all)
                bar = next((m.sort(descending=True).values[k - 1] for m in (smax, gmax) if k < len(m)), -INF)
                groups = int((gmax >= bar).sum())
            elif p < 1:  # its cut comes from a histogram of the weights: not mirrored here
                out.append("")
                continue
            else:  # min_p's bar on each group's max, half a bin low
                gx = (gmax * (1.0 / temps[i])).clamp(max=3.4028234663852886e38)
                z = (gx - xs.max()) * 1.4426950408889634
                groups = int((z >= torch.log2(torch.tensor(max(m, 1e-30))) - 0.5).sum())
            out.append("candidates" if groups * GROUP <= cap else "whole row")
    return out


@pytest.mark.parametrize("programs, stats_block_v, dtype, shares", [
    # the whole-row search's flagged rows shared out from the threshold kernel's list (16 rows here)
    (1024, 8192, torch.bfloat16, None),
    # (SPREAD_PROGRAMS, STATIC_ROWS): each row its own programs, split as they allow (fp16: three
    # passes of pivots, fp32: five); as many programs as rows, one a flagged row
    (2, 64, torch.float16, (256, 16)), (2, 64, torch.float32, (256, 16)),
    (2, 64, torch.float16, (1, 8))])
def test_thresholds_from_candidates_and_whole_rows(programs, stats_block_v, dtype, shares, monkeypatch):
    """Both ways to a row's threshold (its candidates, or its whole row when they overflow the
    buffer: the search spread over programs, passes of pivots then a window of keys counted one by
    one) give the reference's bits in one batch; kernels 1 and 2 over one
    program per row or several; the shared workspaces are left as found. The rows flagged for the
    whole-row search are the overflowing ones, every flag rewritten on every call (stale ones here:
    all set)."""
    from graphrt.kernels import rejection_filter_whole
    from graphrt.kernels.counters import counters
    from graphrt.kernels.rejection_filter import GROUP, SUPER, _workspaces
    from graphrt.kernels.rejection_filter_whole import _spread_workspaces

    if shares is not None:
        for name, value in zip(("SPREAD_PROGRAMS", "STATIC_ROWS"), shares):
            monkeypatch.setattr(rejection_filter_whole, name, value)
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    b, r, v = 8, 2, 75
    x = hazard_logits(b, r, v, gen, dtype)
    temps = torch.tensor([1.0, 0.5, 1.3, 0.0, 0.8, 100.0, 1.0, 0.7])
    seen = set()
    cap = 2 * GROUP
    for kinds in (("top_k",), ("top_p",), ("min_p",), ("top_k", "top_p", "min_p"), ("top_p", "min_p")):
        f = random_filters(b, v, gen, kinds)
        if "top_k" in f:
            f["top_k"][::3] = 7  # more than the row's groups: all of them are candidates
        args = [f.get(name) for name in ("top_k", "top_p", "min_p")]
        ref = thresholds_reference(x, temps, *args).flatten()
        whole = torch.ones(b * r, dtype=torch.int32)
        got = thresholds_triton(x, temps, *args, block_v=16, num_warps=4, pdl=0, cap=cap, programs=programs,
                                stats_block_v=stats_block_v, whole=whole)
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), \
            f"seed {seed} {kinds}: {got} vs {ref}"
        way = _candidates(x, temps, f, cap, min(SUPER, min(stats_block_v, triton.next_power_of_2(v)) // GROUP))
        filtering = _filtering(f, b, v)
        active = [bool(temps[i] > 0 and filtering[i]) for i in range(b) for _ in range(r)]
        want = [{"candidates": 0, "whole row": 1}.get(w, None if a else 0) for w, a in zip(way, active)]
        assert all(w is None or w == int(h) for w, h in zip(want, whole)), f"seed {seed} {kinds}: {whole} vs {want}"
        seen.update(way)
    assert {"candidates", "whole row"} <= seen, f"seed {seed}: {seen}"
    used = [ws for key, ws in _workspaces.items() if key[1:3] == (cap, triton.cdiv(v, GROUP))]
    assert used and all(bool((kmax == -(2**31 - 1)).all()) and not mass.any() and not hist.any()
                        for kmax, mass, hist, *_ in used)
    wcnt = _spread_workspaces[x.device][-1]
    ctr = counters(x.device, 1)
    assert not ctr.any() and not wcnt.any(), f"seed {seed}"


CASES = {  # name: (temps, full_q, ragged, launch fields)
    # one-hot rows drawn by the threshold kernel from their candidates (all of them fit at V = 75)
    "onehot_fused": ([1.0, 0.5, 1.3], False, False, dict(fuse_race=True)),
    # two groups of candidates at most: most rows read whole again, and the walk races their chunk
    "onehot_race_pass": ([1.3, 0.7], False, True, dict(fuse_race=False, filter_cap=32)),
    "fullq": ([0.9, 1.3], True, False, {}),
    "mixed": ([0.0, 1.0, float("nan"), 0.5], False, True, dict(fuse_race=False, filter_draw=False)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_triton_matches_reference_with_filters(name):
    temps, full_q, ragged, fields = CASES[name]
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    dtype = [torch.float32, torch.bfloat16, torch.float16][seed % 3]
    b = 12 if name == "onehot_race_pass" else 6  # the walk races one row per request: more of them
    args = make_inputs(b, 3, 75, gen=gen, temps=temps, full_q=full_q, ragged=ragged, hazards=True, dtype=dtype)
    args["target_logits"][::2] = tied(args["target_logits"][::2].float()).to(dtype)
    f = random_filters(b, 75, gen)
    counts_ref = torch.zeros(3, dtype=torch.int64)
    counts_tri = counts_ref.clone()
    ref = rejection_sample_reference(**args, **f, acceptance_counts=counts_ref, race_chunk=32)
    got = rejection_sample_triton(**args, **f, acceptance_counts=counts_tri, race_chunk=32,
                                  config=small_config(args, **fields))
    msg = f"seed {seed} dtype {dtype}"
    assert_same_result(got, ref, msg, counts=(counts_tri, counts_ref))
    check_outputs_valid(got, args)


DRAW_CASES = {  # name: (K, filter_cap, fuse_race); CASES["mixed"] runs without the draws
    "fit_fused": (3, None, True),  # every candidate set fits
    "overflow_walk_race": (3, 32, False),  # two groups: many rows search their whole row
    "k0": (0, None, False),
}


@pytest.mark.parametrize("name", list(DRAW_CASES))
def test_rows_drawn_from_candidates(name, monkeypatch):
    """A sampled row whose threshold its candidates held is drawn by the threshold kernel, and
    nothing reads its logits after that: they are NaN by then here (poisoned once the threshold
    kernel returns), yet every token and count is the reference's. Mixed batch: greedy (0 and NaN
    temperature), unfiltered and filtered requests, rows dead or with NaN / +inf, invalid drafts,
    ragged drafts (a bonus row with a draft beside it excludes none), V = 75 (no tile divides it),
    3-5 race chunks; rows overflowing the candidates take the whole-row path."""
    import graphrt.kernels.rejection as rejection
    from graphrt.kernels.rejection_filter import FILTER_CAP, GROUP

    k, cap, fuse = DRAW_CASES[name]
    cap = FILTER_CAP if cap is None else cap
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    b, v = 8, 75
    dtype = [torch.bfloat16, torch.float32, torch.float16][seed % 3]
    temps = [1.0, 0.0, 0.7, float("nan"), 1.3, 0.5, 1.0, 0.9]
    args = make_inputs(b, k, v, gen=gen, temps=temps, ragged=True, hazards=True, dtype=dtype)
    x = args["target_logits"]
    x[::2] = tied(x[::2].float()).to(dtype)
    x[7, :, 10], x[7, :, 40] = 50.0, 48.0  # top_k 2 keeps two groups: they fit even the small buffer
    if k:  # request 7's row 0 is its bonus row: the draft beside it stays in the race (p 0.9)
        args["num_draft_tokens"][7], args["draft_token_ids"][7, 0] = 0, 10
    f = random_filters(b, v, gen)
    f["top_k"][0] = 8  # every group of request 0, over the small buffer
    f["top_k"][7], f["top_p"][7], f["min_p"][7] = 2, 1.0, 0.0
    f["top_k"][6], f["top_p"][6], f["min_p"][6] = 0, 1.0, 0.0  # sampled, unfiltered
    f["top_k"][5], f["top_p"][5], f["min_p"][5] = 0, 1.0, 0.1  # every row dead (K > 0): drawn from no candidates
    chunk = [16, 32][(seed // 3) % 2]
    ref = rejection_sample_reference(**args, **f, race_chunk=chunk)

    real = rejection.thresholds_triton
    seen = {}

    def poisoning(logits, *a, draws=None, **kw):
        seen["whole"] = torch.ones(b * (k + 1), dtype=torch.int32)  # stale flags: every one must be rewritten
        tau = real(logits, *a, draws=draws, whole=seen["whole"], **kw)
        seen["draws"] = draws
        logits.view(-1, v)[draws.stats_i[0] != 0] = float("nan")
        return tau

    class RowPassSpy:  # the row pass's launch keywords: it must be told which rows to skip
        def __getitem__(self, grid):
            def launch(*a, **kw):
                seen["row pass"] = kw
                a[7].fill_(float("nan"))  # its stat planes: nothing of a drawn row's may be read from them
                a[8].fill_(2**30)
                return kernel[grid](*a, **kw)
            return launch

    kernel = rejection._row_stats_kernel
    monkeypatch.setattr(rejection, "thresholds_triton", poisoning)
    monkeypatch.setattr(rejection, "_row_stats_kernel", RowPassSpy())
    got = rejection_sample_triton(**clone_args(args), **f, race_chunk=chunk, config=small_config(
        args, fuse_race=fuse, filter_cap=cap, filter_draw=True))
    msg = f"seed {seed} dtype {dtype} race_chunk {chunk}"
    assert_same_result(got, ref, msg)
    check_outputs_valid(got, args)
    stats_i = seen["draws"].stats_i
    assert seen["row pass"].get("DRAWN") and seen["row pass"].get("dstat_i_ptr") is stats_i, msg
    drawn = (stats_i[0] != 0).view(b, k + 1)
    whole = (seen["whole"] != 0).view(b, k + 1)
    sampled = torch.tensor(temps) > 0
    filtering = _filtering(f, b, v)
    assert not bool((drawn & ~(sampled & filtering)[:, None]).any()), f"{msg}: {drawn}"
    # every sampled row that filters is drawn from its candidates or searched whole, never both
    assert torch.equal(drawn ^ whole, (sampled & filtering)[:, None].expand(b, k + 1)), f"{msg}: {drawn} {whole}"
    assert bool(drawn[5].all()) and bool(drawn[7].all()), f"{msg}: {drawn}"
    way = torch.tensor([w == "candidates" for w in _candidates(x, torch.tensor(temps), f, cap, 8)]).view(b, k + 1)
    assert bool(drawn[way].all()), f"{msg}: {drawn} vs {way}"  # top_p alone: not mirrored, may go either way
    if cap < v:  # both kinds of row in the batch
        assert not bool(drawn[0].any()) and bool(whole[0].all()), f"{msg}: {drawn} {whole}"
        assert cap == 2 * GROUP


def test_filters_off_change_nothing():
    """top_k = 0, top_p = 1, min_p = 0 on every request: the same bits as no filter at all."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    args = make_inputs(6, 3, 75, gen=gen, temps=[1.0, 0.0, 0.7], hazards=True)
    off = dict(top_k=torch.zeros(6, dtype=torch.int64), top_p=torch.ones(6), min_p=torch.zeros(6))
    for fn in (lambda **a: rejection_sample_reference(**a, race_chunk=32),
               lambda **a: rejection_sample_triton(**a, race_chunk=32, config=small_config(args))):
        plain, filtered = fn(**args), fn(**args, **off)
        assert torch.equal(plain.token_ids, filtered.token_ids), f"seed {seed}"
        assert torch.equal(plain.num_emitted, filtered.num_emitted), f"seed {seed}"
        assert torch.equal(plain.logprobs.view(torch.int32), filtered.logprobs.view(torch.int32)), f"seed {seed}"


@pytest.mark.parametrize("which", ["top_k", "top_p", "min_p"])
def test_one_token_left_samples_like_greedy(which):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    b = 6
    args = make_inputs(b, 3, 75, gen=gen, temps=[1.0, 1.3, 0.5])  # fp32 randn: one maximum per row
    f = {"top_k": dict(top_k=torch.ones(b, dtype=torch.int64)), "top_p": dict(top_p=torch.full((b,), 1e-6)),
         "min_p": dict(min_p=torch.full((b,), 0.999999))}[which]
    greedy = rejection_sample_reference(**{**args, "temperature": torch.zeros(b)})
    for res in (rejection_sample_reference(**args, **f),
                rejection_sample_triton(**args, **f, config=small_config(args))):
        assert torch.equal(res.token_ids, greedy.token_ids), f"seed {seed}"
        assert torch.equal(res.num_emitted, greedy.num_emitted), f"seed {seed}"
        n = res.num_emitted.long()
        assert (res.logprobs[torch.arange(3 + 1)[None, :] < n[:, None]] == 0).all()  # p = 1 once filtered


def test_filtered_draft_is_always_rejected():
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    b, k, v = 512, 2, 30
    args = make_inputs(b, k, v, gen=gen, temps=[1.0, 2.0, 0.5])
    order = args["target_logits"].float().argsort(dim=-1, descending=True)
    args["draft_token_ids"] = order[:, :k, 5]  # the 6th most likely token: outside top_k = 5
    args.update(top_k=torch.full((b,), 5), top_p=torch.ones(b))
    few = {key: (val[:8] if isinstance(val, torch.Tensor) else val) for key, val in args.items()}
    for res, n in ((rejection_sample_reference(**args), b),
                   (rejection_sample_triton(**few, config=small_config(few)), 8)):
        assert (res.num_emitted == 1).all(), f"seed {seed}"
        assert bool((res.token_ids[:, 0][:, None] == order[:n, 0, :5]).any(-1).all()), f"seed {seed}"


def test_seeded_request_with_filters_independent_of_batch():
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    one = make_inputs(1, 3, 30, gen=gen, temps=[0.9])
    mine = dict(top_k=torch.tensor([7]), top_p=torch.tensor([0.8]), min_p=torch.tensor([0.05]))
    expected = rejection_sample_reference(**one, **mine)
    for b, slot in [(5, 0), (9, 8)]:
        batch = make_inputs(b, 3, 30, gen=gen, temps=[0.0, 1.2, 0.7])
        f = random_filters(b, 30, gen)
        for key in ("target_logits", "draft_token_ids", "temperature", "seed", "position"):
            batch[key][slot] = one[key][0]
        for key in f:
            f[key][slot] = mine[key][0]
        for res in (rejection_sample_reference(**batch, **f),
                    rejection_sample_triton(**batch, **f, config=small_config(batch, num_splits=1))):
            assert torch.equal(res.token_ids[slot], expected.token_ids[0]), f"seed {seed}"
            assert res.num_emitted[slot] == expected.num_emitted[0], f"seed {seed}"


def test_filter_validation():
    args = make_inputs(2, 1, 10, gen=torch.Generator().manual_seed(0), temps=[1.0])
    for override, name in [(dict(top_k=torch.tensor([1, -1])), "top_k"), (dict(top_k=torch.ones(2)), "top_k"),
                           (dict(top_p=torch.tensor([0.0, 0.5])), "top_p"), (dict(top_p=torch.ones(3)), "top_p"),
                           (dict(top_p=torch.tensor([1.5, 0.5])), "top_p"),
                           (dict(min_p=torch.tensor([1.0, 0.0])), "min_p"),
                           (dict(min_p=torch.tensor([-0.1, 0.0])), "min_p")]:
        for fn in (rejection_sample, rejection_sample_triton):
            with pytest.raises(ValueError, match=name):
                fn(**args, **override)


# --- the sampling law, per position (reference, vectorized over 1e5 requests) --------------------


def _filtered_probs(row_logits, temp, k, p, m):
    """Per row: the target distribution the filters leave (float64), the threshold from the rule."""
    out = []
    for row in row_logits:
        tau = rule_tau(row, float(1.0 / torch.tensor(temp, dtype=torch.float32)), k, p, m)
        x = torch.where(row >= tau, row.double() / temp, torch.full_like(row.double(), -INF))
        out.append(torch.softmax(x, -1))
    return torch.stack(out)


LAW = {  # name: (top_k, top_p, min_p, full_q)
    "top_k": (4, 1.0, 0.0, False),
    "top_p": (0, 0.8, 0.0, False),
    "min_p": (0, 1.0, 0.1, False),
    "all": (6, 0.9, 0.05, False),
    "all_fullq": (6, 0.9, 0.05, True),
}


@pytest.mark.parametrize("temp", [0.5, 1.3])
@pytest.mark.parametrize("name", list(LAW))
def test_reference_follows_filtered_distribution(name, temp):
    top_k, top_p, min_p, full_q = LAW[name]
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    n, k, v = 100_000, 2, 13
    while True:
        # Ties at the thresholds (halves), peaked enough that many requests reach position K.
        row_logits = tied(torch.randn(k + 1, v, generator=gen) * 1.5)
        row_logits[torch.arange(k + 1), torch.randint(0, v, (k + 1,), generator=gen)] += 2.0
        q_logits = row_logits[:k] + 0.5 * torch.randn(k, v, generator=gen)
        q = torch.softmax(q_logits / temp, -1)
        p = _filtered_probs(row_logits, temp, top_k, top_p, min_p)
        accept = torch.minimum(p[:k], q.double()).sum(-1) if full_q else (p[:k] * q.double()).sum(-1)
        if n * float(accept.prod()) >= 3000:
            break
    drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=gen) for j in range(k)], 1)
    args = dict(target_logits=row_logits.expand(n, k + 1, v), draft_token_ids=drafts,
                temperature=torch.full((n,), temp),
                seed=torch.randint(-(2**62), 2**62, (n,), generator=gen, dtype=torch.int64),
                position=torch.randint(0, 2**31, (n,), generator=gen, dtype=torch.int64),
                draft_logits=q_logits.expand(n, k, v) if full_q else None,
                top_k=torch.full((n,), top_k), top_p=torch.full((n,), top_p), min_p=torch.full((n,), min_p))
    res = rejection_sample_reference(**args, race_chunk=4)  # one-hot: a two-level race over 4 chunks
    for j in range(k + 1):
        tokens = res.token_ids[res.num_emitted > j, j]
        assert tokens.numel() > 1000
        pv = chi2_pvalue(tokens, p[j])
        assert pv > CHI2_ALPHA, f"seed {seed} position {j} p-value {pv}"


# --- GPU: real sizes, both computed on the device ------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b", [1, 8, 64])
@pytest.mark.parametrize("full_q", [False, True])
def test_triton_matches_reference_with_filters_gpu(cuda, full_q, b, dtype):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    k, v = 3, 128256
    args = make_inputs(b, k, 8, gen=gen, temps=[1.0, 0.0, 0.7, 1.3])  # small CPU draft, then real size
    target = (torch.randn(b, k + 1, v, device=cuda) * 3).to(dtype)
    qlogits = (target[:, :k].float() + torch.randn(b, k, v, device=cuda)).to(dtype)
    drafts = torch.multinomial(torch.softmax(qlogits.float(), -1).reshape(-1, v), 1).reshape(b, k)
    drafts[::3] = target[::3, :k].float().argmax(-1)
    f = {"top_k": torch.tensor([50, 0, 1000, 1])[torch.arange(b) % 4], "top_p": torch.tensor([0.9, 1.0, 0.5, 0.99])[
        torch.arange(b) % 4], "min_p": torch.tensor([0.0, 0.05, 0.0, 0.1])[torch.arange(b) % 4]}
    args = {key: (val.to(cuda) if isinstance(val, torch.Tensor) else val) for key, val in {**args, **f}.items()}
    args.update(target_logits=target, draft_token_ids=drafts, draft_logits=qlogits if full_q else None)
    tau_ref = thresholds_reference(target, args["temperature"], args["top_k"], args["top_p"], args["min_p"])
    tau = thresholds_triton(target, args["temperature"], args["top_k"], args["top_p"], args["min_p"],
                            block_v=1024, num_warps=8, pdl=0)
    assert torch.equal(tau.view(torch.int32), tau_ref.flatten().view(torch.int32)), f"seed {seed}"
    ref = rejection_sample_reference(**args)
    got = rejection_sample(**args)
    assert_same_result(got, ref, f"seed {seed}", tol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 64, 256])
def test_drawn_rows_match_whole_row_pass_gpu(cuda, b):
    """The bench's top_k 50 + top_p 0.9 beside greedy, unfiltered and overflowing requests (top_k
    1000: a thousand groups, over the candidate buffer): the rows drawn from their candidates give
    the reference's tokens, and so does every row read whole again (filter_draw off)."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    k, v = 3, 128256
    args = make_inputs(b, k, 8, gen=gen, temps=[1.0, 0.0, 0.7, 1.3, 0.9], ragged=True)
    target = (torch.randn(b, k + 1, v, device=cuda) * 3).to(torch.bfloat16)
    drafts = torch.multinomial(torch.softmax(target[:, :k].float() + 1, -1).reshape(-1, v), 1).reshape(b, k)
    drafts[::3] = target[::3, :k].float().argmax(-1)
    i = torch.arange(b) % 5
    f = {"top_k": torch.tensor([50, 50, 0, 1000, 50])[i], "top_p": torch.tensor([0.9, 0.9, 1.0, 0.9, 0.9])[i]}
    args = {key: (val.to(cuda) if isinstance(val, torch.Tensor) else val) for key, val in {**args, **f}.items()}
    args.update(target_logits=target, draft_token_ids=drafts)
    ref = rejection_sample_reference(**args)
    got = rejection_sample(**args)
    for draw in (True, False):  # the default draws from 16 rows on: both ways at every size
        way = rejection_sample_triton(**args, config=dataclasses.replace(launch_config(b, k, False), filter_draw=draw))
        assert_same_result(way, ref, f"seed {seed} filter_draw {draw}", tol=1e-4)
    assert_same_result(got, ref, f"seed {seed}", tol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("b", [1, 64])
def test_flat_rows_searched_whole_gpu(cuda, b, dtype):
    """Flat rows (randn at temperature 1 and 1.5) whose kept entries overflow the candidates: top_p
    alone, min_p alone (a tiny bar) and both, on requests side by side with top_k ones. Their
    thresholds come from the whole-row search spread over many programs (bf16, fp16) or the
    one-program one (fp32), bit for bit the reference's; the sampler's tokens are the reference's."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    k, v = 3, 128256
    args = make_inputs(b, k, 8, gen=gen, temps=[1.0, 1.5, 1.0, 0.7])
    target = torch.randn(b, k + 1, v, device=cuda, generator=torch.Generator(cuda).manual_seed(seed)).to(dtype)
    drafts = target[:, :k].float().argmax(-1)
    drafts[::2] = torch.randint(0, v, drafts[::2].shape, device=cuda)
    i = torch.arange(b) % 4
    f = {"top_k": torch.tensor([0, 0, 0, 300])[i], "top_p": torch.tensor([0.9, 1.0, 0.95, 0.8])[i],
         "min_p": torch.tensor([0.0, 1e-3, 0.02, 0.0])[i]}
    args = {key: (val.to(cuda) if isinstance(val, torch.Tensor) else val) for key, val in {**args, **f}.items()}
    args.update(target_logits=target, draft_token_ids=drafts)
    tau_ref = thresholds_reference(target, args["temperature"], args["top_k"], args["top_p"], args["min_p"])
    whole = torch.zeros(b * (k + 1), dtype=torch.int32, device=cuda)
    for _ in range(2):  # the second call finds the workspace the first one left
        tau = thresholds_triton(target, args["temperature"], args["top_k"], args["top_p"], args["min_p"],
                                block_v=2048, num_warps=8, pdl=0, whole=whole)
        assert torch.equal(tau.view(torch.int32), tau_ref.flatten().view(torch.int32)), f"seed {seed}"
    assert int(whole.sum()) >= b * (k + 1) // 2, f"seed {seed}: flat rows should overflow the candidates"
    assert_same_result(rejection_sample(**args), rejection_sample_reference(**args), f"seed {seed}", tol=1e-4)
