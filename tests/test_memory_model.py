"""The memory model (opd_sao/memory.py) against a real model's parameter count and hand-computed cases."""
from __future__ import annotations

import pytest
from transformers import Qwen2Config, Qwen2ForCausalLM

from opd_sao.memory import ModelShape, step_memory

# 1 layer, hidden 4, MLP 8, 2 heads of 2, 1 kv head (KV = 2), vocabulary 16, tied
SMALL = ModelShape(layers=1, hidden=4, intermediate=8, heads=2, kv_heads=1, vocab=16)


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_counts_are_the_real_models(tied):
    config = Qwen2Config(vocab_size=500, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    model = Qwen2ForCausalLM(config)
    shape = ModelShape.of(config)
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.backbone_params == sum(p.numel() for p in model.model.parameters())
    assert shape.mlp_params == sum(p.numel() for n, p in model.named_parameters() if ".mlp." in n)


def test_a_hand_computed_step():
    # params: embedding 64; layer: q, o 2 x 16, k, v 2 x 8, biases 4 + 2 + 2, MLP 3 x 32, norms 8 -> 160; norm 4
    assert (SMALL.kv, SMALL.params, SMALL.mlp_params) == (2, 228, 96)
    assert SMALL.layer_activations == 10 * 4 + 3 * 2 + 4 * 8 == 78
    plain = step_memory(SMALL, 10)
    assert plain["policy_weights"] == plain["policy_grads"] == 4 * 228 and plain["policy_optimizer"] == 8 * 228
    assert plain["activations"] == 4 * 10 * (78 + 12) and plain["recompute"] == 0
    assert plain["lm_head_chunk"] == 4 * 2 * 10 * 16
    assert plain["embedding_grad"] == 4 * 16 * 4  # tied: the lookup's dense [V, H] gradient
    assert plain["peak"] == 16 * 228 + max(3600 + 1280 + 256, 4 * 228)
    ckpt = step_memory(SMALL, 10, checkpointing=True, critic=True)
    assert ckpt["activations"] == 4 * 10 * (4 + 12) and ckpt["recompute"] == 4 * 10 * 78
    assert ckpt["critic_weights"] == 4 * 228 and ckpt["critic_grads"] == 4 * 96
    assert ckpt["critic_optimizer"] == 8 * 96


def test_zero_stages_shard_what_they_shard_and_bf16_adds_a_master_copy():
    big = ModelShape(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=1000, tied=False)
    P = big.params
    by_stage = [step_memory(big, 100, world=8, zero=z, precision="bfloat16", teacher=big) for z in range(4)]
    assert [m["policy_optimizer"] for m in by_stage] == [12 * P, 12 * P / 8, 12 * P / 8, 12 * P / 8]
    assert [m["policy_grads"] for m in by_stage] == [2 * P, 2 * P, 2 * P / 8, 2 * P / 8]
    assert [m["policy_weights"] for m in by_stage] == [2 * P, 2 * P, 2 * P, 2 * P / 8]
    assert [m["teacher_weights"] for m in by_stage] == [2 * P, 2 * P, 2 * P, 2 * P / 8]
    assert all(a["peak"] > b["peak"] for a, b in zip(by_stage, by_stage[1:]))
    with pytest.raises(ValueError, match="precision"):
        step_memory(big, 1, precision="fp8")
