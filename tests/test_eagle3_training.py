"""EAGLE-3 training (graphrt/train) on a tiny random target, CPU, fp32.

The trainer's teacher-forced estimate comes from transformers' forward and the trainer's own head
module; graphrt's acceptance from its runtime. They agree only if graphrt feeds the head the aux
layers, positions, hidden states and attention of the training-time test, so they must agree
per request, exactly, where nothing sits near a tie.
"""

from __future__ import annotations

import pytest
import torch

from graphrt.checkpoint import load_checkpoint
from graphrt.checkpoint_writer import write_random_checkpoint
from graphrt.config import default_eagle3_aux_layer_ids
from graphrt.params import SamplingParams
from graphrt.runtime import Runtime

pytest.importorskip("transformers")
from graphrt.train import acceptance, data, loop, teacher  # noqa: E402
from graphrt.train.head import Eagle3Trainable  # noqa: E402

NEW = 40


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3train")
    write_random_checkpoint(root / "target", "tiny", dtype=torch.float32, seed=3)
    ck = load_checkpoint(root / "target", dtype=torch.float32)
    cfg = ck.config
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, cfg.vocab_size, (48, 6), generator=g).tolist()
    rt = Runtime(ck, None, max_batch_size=16, max_seq_len=80, device="cpu")
    seqs = data.generate(rt, prompts[:40], max_new_tokens=NEW, temperature=0.0, seed=0)
    held = data.generate(rt, prompts[40:], max_new_tokens=NEW, temperature=0.0, seed=0)
    ids, coverage = data.draft_vocabulary(seqs, cfg.vocab_size, 256)
    teach = teacher.hf_model(ck, device="cpu", dtype=torch.float32)
    aux_ids = default_eagle3_aux_layer_ids(cfg.num_hidden_layers)
    batches = loop.prepare(teach, seqs, aux_ids, ids, ck.weights["lm_head.weight"], token_budget=1024,
                           device="cpu")
    head = Eagle3Trainable.for_target(cfg, ck.weights, ids, seed=0)
    log = loop.train(head, batches, ck.weights["lm_head.weight"][ids], steps=3, epochs=30, max_seconds=0,
                     lr=3e-3, seed=0, log_every=10, say=lambda _: None)
    head.save(root / "head", dtype=torch.float32)
    return dict(ck=ck, head=head.eval(), head_dir=root / "head", held=held, prompts=prompts[40:], teach=teach,
                aux_ids=aux_ids, log=log, coverage=coverage, draft_ids=ids)


def test_loss_falls_and_vocab_covers(trained):
    log = trained["log"]
    assert log.epochs == 30
    assert log.loss[-1] < log.loss[0]
    assert 0.5 < trained["coverage"][256] <= 1.0
    assert trained["draft_ids"].tolist() == sorted(set(trained["draft_ids"].tolist()))


def test_saved_head_is_the_published_layout(trained):
    from safetensors import safe_open

    with safe_open(str(trained["head_dir"] / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight",
            "midlayer.self_attn.q_proj.weight", "midlayer.mlp.down_proj.weight"} <= keys
    ids = trained["draft_ids"]
    assert torch.equal(torch.arange(ids.numel()) + d2t, ids)
    assert torch.equal(t2d.nonzero().flatten(), ids)
    d = load_checkpoint(trained["head_dir"])
    assert d.kind == "eagle3" and d.config.draft_vocab_size == ids.numel()


@pytest.mark.parametrize("K", [1, 5])
def test_greedy_spec_with_an_accepting_head_equals_plain(trained, K):
    draft = load_checkpoint(trained["head_dir"], dtype=torch.float32)
    spec = Runtime(trained["ck"], draft, num_draft_tokens=K, max_batch_size=4, max_seq_len=80, device="cpu",
                   buckets=(1, 2, 4))
    gens = spec.generate(trained["prompts"], SamplingParams(max_new_tokens=NEW))
    assert [g.token_ids for g in gens] == [s.tokens[s.prompt_len:] for s in trained["held"]]
    assert sum(g.num_accepted_tokens for g in gens) > 0


def test_estimate_equals_graphrt_acceptance(trained):
    ck, held = trained["ck"], trained["held"]
    draft = load_checkpoint(trained["head_dir"], dtype=torch.float32)
    spec = Runtime(ck, draft, num_draft_tokens=3, max_batch_size=16, max_seq_len=80, device="cpu")
    gens = spec.generate(trained["prompts"], SamplingParams(max_new_tokens=NEW))
    idx = list(range(len(held)))
    ids, lengths, plens = data.pad(held, idx, "cpu")
    aux, _ = teacher.features(trained["teach"], ids, lengths, trained["aux_ids"])
    preds = acceptance.chain_predictions(trained["head"], aux, ids, 3)
    est, got, agree = [], [], 0
    for r, (gen, seq) in enumerate(zip(gens, held)):
        assert gen.token_ids == seq.tokens[seq.prompt_len:]  # greedy spec == plain greedy
        dec, cyc = acceptance.walk(preds[r], seq.tokens, seq.prompt_len, 3)
        est.append(dec / cyc)
        got.append(gen.mean_acceptance_length)
        agree += gen.num_cycles == cyc
    assert max(got) > 1.3  # the head does accept drafts, so the accepted path is exercised
    assert agree >= len(held) - 1
    assert sum(got) == pytest.approx(sum(est), rel=0.02)
    counts = acceptance.chain_counts(preds, ids, plens, lengths, 3)
    assert counts[0][0] > counts[0][1] > 0 and counts[1][0] == counts[0][1]


def test_walk_counts_like_the_runtime():
    # preds[k][n-2] proposes position n + k; prompt of 2, then 6 generated tokens
    tokens = [5, 6, 10, 11, 12, 13, 14, 15]
    preds = torch.full((3, 8), -1)
    preds[0, 1], preds[1, 1], preds[2, 1] = 11, 12, 99  # cycle 1 (n = 3): accepts 2, emits 3
    preds[0, 4] = 14  # cycle 2 (n = 6): accepts 1, emits 2 -> done
    assert acceptance.walk(preds, tokens, 2, 3) == (5, 2)
    assert acceptance.walk(preds, tokens, 2, 1) == (5, 3)  # 2 + 1 + 2


def test_saved_sequences_load_back_the_same(trained, tmp_path):
    """scripts/train_eagle3.py --save-sequences / --sequences: a later run trains on exactly the
    generations an earlier one wrote, in the same order and groups."""
    held = trained["held"]
    train = [data.Sequence(s.tokens, s.prompt_len, 0.7) for s in held[:3]]  # a sampled group too
    path = tmp_path / "seqs.jsonl.gz"
    data.save_sequences(path, {"train": train, "heldout": held})
    back = data.load_sequences(path)
    assert list(back) == ["train", "heldout"]
    assert back["train"] == train and back["heldout"] == held
