"""A checkpoint written by transformers' save_pretrained loads in graphrt and gives the same logits
as transformers' own forward (fp32)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from graphrt.checkpoint import load_checkpoint  # noqa: E402
from graphrt.kv_cache import KVPool  # noqa: E402
from graphrt.models import build_target  # noqa: E402
from graphrt.models.layers import AttentionMetadata  # noqa: E402

COMMON = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)


def _configs():
    yield "llama", transformers.LlamaConfig(**COMMON, rope_theta=500000.0, tie_word_embeddings=True,
                                            rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 32})
    yield "llama-untied", transformers.LlamaConfig(**COMMON, tie_word_embeddings=False)
    yield "qwen2", transformers.Qwen2Config(**COMMON, tie_word_embeddings=False)
    yield "qwen3", transformers.Qwen3Config(**COMMON, head_dim=24, tie_word_embeddings=True)


@pytest.mark.parametrize("name,config", list(_configs()), ids=lambda x: x if isinstance(x, str) else "")
def test_logits_match_transformers(tmp_path, name, config):
    torch.manual_seed(0)
    cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "qwen3": transformers.Qwen3ForCausalLM}[name.split("-")[0]]
    hf = cls(config).eval()
    with torch.no_grad():  # the default init is tiny; widen it so the test is not trivially close
        for p in hf.parameters():
            p.normal_(0, 0.2)
    hf.save_pretrained(tmp_path)
    ids = torch.randint(0, config.vocab_size, (1, 45))
    with torch.no_grad():
        ref = hf(ids).logits[0].float()

    ckpt = load_checkpoint(tmp_path, dtype=torch.float32)
    model = build_target(ckpt, 256, "cpu")
    c = ckpt.config
    kv = KVPool.allocate(c.num_hidden_layers, 8, 16, c.num_key_value_heads, c.head_dim, torch.float32, "cpu")
    P = ids.shape[1]
    table = torch.tensor([[3, 1, 5, 0]], dtype=torch.int32)  # out of order on purpose
    pos = torch.arange(P)
    meta = AttentionMetadata(block_tables=table, seq_lens=torch.tensor([P], dtype=torch.int32),
                             slot_mapping=table[0, pos // 16].long() * 16 + pos % 16, query_len=P, max_seq_len=64)
    hidden, _ = model.forward(ids[0], pos, meta, kv)
    ours = model.logits(hidden)
    err = (ours - ref).abs().max().item() / ref.abs().max().item()
    assert err < 1e-5, f"{name}: max relative error {err}"
