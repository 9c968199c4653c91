"""The critic's trainable set (frozen attention), chosen by module role on every architecture family we support."""
from __future__ import annotations

import json

import pytest
import torch
from gradients import assert_same_gradients
from transformers import AutoModel, LlamaConfig, MambaConfig, MixtralConfig, Qwen2Config, Qwen2MoeConfig, Qwen3MoeConfig

from opd_sao.app.cli import main
from opd_sao.trainers.critic import ValueModel, describe_critic

SMALL = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1)
DENSE = {f"layers.{i}.mlp.{p}_proj.weight" for i in range(2) for p in ("gate", "up", "down")}
EXPERTS = {f"layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")}
SHARED = {f"layers.{i}.mlp.shared_expert.{p}_proj.weight" for i in range(2) for p in ("gate", "up", "down")}
ROUTERS = {f"layers.{i}.mlp.gate.weight" for i in range(2)}
SHARED_GATES = {f"layers.{i}.mlp.shared_expert_gate.weight" for i in range(2)}
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
# config -> (the backbone parameters the critic trains, the routers it keeps frozen)
CASES = {
    "llama": (LlamaConfig(**SMALL), DENSE, set()),
    "qwen2": (Qwen2Config(**SMALL), DENSE, set()),
    "mixtral": (MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2), EXPERTS, ROUTERS),
    "qwen2_moe": (Qwen2MoeConfig(**SMALL, **MOE, shared_expert_intermediate_size=8), EXPERTS | SHARED,
                  ROUTERS | SHARED_GATES),
    "qwen3_moe": (Qwen3MoeConfig(**SMALL, **MOE), EXPERTS, ROUTERS),
}


def _critic(config) -> ValueModel:
    torch.manual_seed(0)
    backbone = AutoModel.from_config(config)
    return ValueModel(backbone, config.hidden_size)


@pytest.mark.parametrize("arch", sorted(CASES))
def test_critic_trains_the_feed_forward_blocks_only(arch):
    config, expected, routers = CASES[arch]
    critic = _critic(config)
    critic.freeze_attention()
    trainable = {name for name, p in critic.backbone.named_parameters() if p.requires_grad}
    assert trainable == expected
    assert all(p.requires_grad for p in critic.value_head.parameters())
    assert routers <= {name for name, p in critic.backbone.named_parameters() if not p.requires_grad}

    # a real value-loss step moves exactly that set: attention, routers, norms and embeddings keep their values
    before = {name: p.detach().clone() for name, p in critic.backbone.named_parameters()}
    opt = torch.optim.SGD([p for p in critic.parameters() if p.requires_grad], lr=0.5)
    ids = torch.randint(0, config.vocab_size, (3, 7), generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # the zero-initialised head first, then gradients reach the backbone through it
        values = critic(ids, torch.ones_like(ids))
        ((values - 1.0) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    moved = {name for name, p in critic.backbone.named_parameters() if not torch.equal(p, before[name])}
    assert moved == expected
    assert any(".self_attn." in name for name in before)


def test_critic_trained_layers_trains_only_the_top_layers_feed_forward():
    """trainer.critic_trained_layers N: only the last N decoder layers' feed-forward blocks train: a value-loss step
    gets gradients, none below them (the cheaper critic: benchmarks/critic_cost.py); N out of range is refused."""
    config = CASES["llama"][0]
    critic = _critic(config)
    critic.freeze_attention(top_layers=1)
    last = config.num_hidden_layers - 1
    trainable = {name for name, p in critic.backbone.named_parameters() if p.requires_grad}
    assert trainable and all(name.startswith(f"layers.{last}.mlp.") for name in trainable)
    torch.nn.init.normal_(critic.value_head.weight, generator=torch.Generator().manual_seed(3))
    ids = torch.randint(0, config.vocab_size, (3, 7), generator=torch.Generator().manual_seed(1))
    ((critic(ids, torch.ones_like(ids)) - 1.0) ** 2).mean().backward()
    with_grad = {name for name, p in critic.backbone.named_parameters() if p.grad is not None}
    assert with_grad == trainable
    with pytest.raises(ValueError, match="critic_trained_layers is 99"):
        _critic(config).freeze_attention(top_layers=99)


def test_models_check_names_what_the_critic_trains(tmp_path, tiny_model_dir, capsys):
    moe = tmp_path / "mixtral"
    CASES["mixtral"][0].save_pretrained(moe)
    info = describe_critic(moe)
    assert info["trains"] == ["layers.*.mlp.experts.gate_up_proj", "layers.*.mlp.experts.down_proj"]
    assert info["frozen_routers"] == ["layers.*.mlp.gate.weight"] and "refused" not in info
    assert 0 < info["trainable_parameters"] < info["backbone_parameters"]
    assert main(["models", "check", str(tiny_model_dir)]) == 0
    out = capsys.readouterr().out
    assert "critic (SAO, PPO) trains" in out and "layers.*.mlp.down_proj.weight" in out
    assert "layers.*.self_attn.q_proj.weight" in out.split("critic frozen:")[1]
    assert main(["models", "check", str(tiny_model_dir), "--json"]) == 0
    critic = json.loads(capsys.readouterr().out)["critic"]
    assert not any("self_attn" in name for name in critic["trains"])


def test_an_architecture_with_nothing_to_train_is_refused_in_one_line(tmp_path):
    """Mamba layers are a mixer and a norm: no feed-forward block, so the frozen-attention rule has nothing."""
    config = MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2)
    critic = _critic(config)
    with pytest.raises(ValueError) as err:
        critic.freeze_attention()
    message = str(err.value)
    assert len(message.splitlines()) == 1 and "MambaModel" in message and "freeze_critic_attention" in message
    config.save_pretrained(tmp_path / "mamba")
    assert describe_critic(tmp_path / "mamba")["refused"] == message


@pytest.mark.parametrize("arch", sorted(CASES))
def test_values_at_the_actions_only_equal_the_whole_forward_with_their_gradients(arch):
    """`actions`: the critic's values at the action tokens (0 elsewhere) equal the whole forward's there, and so do
    every trainable parameter's gradients, while the last layer's feed-forward block runs only on the states an
    action follows (dense MLPs and MoE blocks alike)."""
    from opd_sao.model import llama_forward
    from opd_sao.model.decoders import decoder_layers, feed_forward_blocks

    config = CASES[arch][0]
    whole, cut = _critic(config), _critic(config)
    llama_forward.keep_transformers(cut.backbone)  # read_only_at (opd-sao's own forward: tests/test_llama_forward.py)
    for critic in (whole, cut):
        critic.freeze_attention()
        torch.nn.init.normal_(critic.value_head.weight, generator=torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, config.vocab_size, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[2, 7:] = 0
    actions = torch.zeros_like(ids)
    actions[0, 4:], actions[1, 2:5], actions[1, 7:], actions[2, 5:] = 1, 1, 1, 1
    seen = []
    block = feed_forward_blocks(decoder_layers(cut.backbone)[-1])[0]
    block.register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape[:-1].numel()))  # its input
    got = cut(ids, mask, actions)
    assert seen == [int((actions * mask).sum())]  # V(s_t) for each action t: one state each
    want = whole(ids, mask) * actions
    assert torch.equal(got != 0, (actions * mask).bool()) and torch.allclose(got, want, atol=1e-6)
    assert_same_gradients(got, want, cut, whole, g, 1e-6)


def test_the_critic_keeps_no_kv_cache(tiny_model_dir):
    """A critic forward never continues from a cache, so it builds none (a no-grad one would hold every layer's
    keys and values to its end)."""
    critic = ValueModel.from_pretrained(tiny_model_dir)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        out = critic.backbone(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert out.to_tuple()[1:] == ()  # the hidden states alone: no cache
