"""opd-sao's own Llama-family forward (opd_sao/model/llama_forward.py) against transformers' on the same weights: the
decoder's hidden states, the engine's prefill and decode through a KV cache, the critic's values and gradients,
and which models keep transformers' forward."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers
from gradients import assert_same_gradients

from opd_sao.engines.base import GenerationRequest, SamplingParams
from opd_sao.engines.embedded import EmbeddedEngine
from opd_sao.model import llama_forward
from opd_sao.model.modeling import batch_kv_cache, position_ids_for
from opd_sao.trainers.critic import ValueModel

SHAPE = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)
NON_REENTRANT = {"use_reentrant": False}  # as trainers.base.prepare enables it
FAMILY = {"Llama": dict(attention_bias=True, mlp_bias=True),  # every projection with a bias
          "Mistral": dict(sliding_window=None), "Qwen2": {}, "Qwen3": dict(head_dim=16)}  # Qwen3: per-head q/k norms


def _model(arch: str, seed: int = 0, attention: str = "eager", **extra):
    """A causal LM of `arch` whose norms are not the identity (initialised to ones, they would hide a misplaced one)."""
    config = getattr(transformers, f"{arch}Config")(**{**SHAPE, **FAMILY.get(arch, {}), **extra})
    config._attn_implementation = attention
    torch.manual_seed(seed)
    model = getattr(transformers, f"{arch}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model


def _batch(generator: torch.Generator, rows: int = 5, width: int = 9, left: bool = True):
    ids = torch.randint(1, SHAPE["vocab_size"], (rows, width), generator=generator)
    mask = torch.ones_like(ids)
    for r in range(rows):  # rows of every length, padded on one side
        pad = r % 4
        if pad:
            mask[r, :pad] = 0 if left else 1
            if not left:
                mask[r, width - pad:] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("arch", list(FAMILY))
@pytest.mark.parametrize("left,attention", [(True, "eager"), (False, "eager"), (True, "sdpa")])
def test_hidden_states_are_transformers(arch, left, attention):
    model = _model(arch, attention=attention)
    assert llama_forward.unsupported(model) is None
    ids, mask = _batch(torch.Generator().manual_seed(1), left=left)
    positions = position_ids_for(mask)
    # every query, a padding one too, attends to something: a row with nothing to attend to is NaN in some kernels
    # (zeros in torch 2.13's CPU one), and a NaN key at a padding column poisons every row through 0 * NaN
    assert llama_forward._allowed(mask, mask.shape[1]).any(-1).all()
    with torch.no_grad():
        want = model.model(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
        got = llama_forward.hidden_states(model, ids, mask, positions)
        real = mask.bool()
        assert (got[real] - want[real]).abs().max() < 1e-5
        read = (real & (torch.rand(mask.shape, generator=torch.Generator().manual_seed(2)) < 0.5)).flatten()
        some = llama_forward.hidden_states(model, ids, mask, positions, read=read.nonzero().squeeze(1))
        assert some.shape == (int(read.sum()), SHAPE["hidden_size"])
        assert (some - want.flatten(0, 1)[read]).abs().max() < 1e-5


@pytest.mark.parametrize("arch", list(FAMILY))
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("width", [9, llama_forward.SHORT_ROWS])  # short rows, then past SHORT_ROWS keys; or never
def test_prefill_and_decode_through_a_cache_are_transformers(arch, attention, width):
    """The engine's join fills the cache as transformers' forward does; each decode step's logits follow."""
    model = _model(arch, attention=attention)
    ids, mask = _batch(torch.Generator().manual_seed(3), width=width)
    ours, theirs = batch_kv_cache(model), batch_kv_cache(model)
    with torch.inference_mode():
        llama_forward.prefill(model, ids, mask, position_ids_for(mask), ours)
        model(input_ids=ids, attention_mask=mask, position_ids=position_ids_for(mask), cache=theirs, use_cache=True)
        for mine, want in zip(ours.layers, theirs.layers):
            real = mask.bool()[:, None, :, None]
            assert ((mine.keys - want.keys).abs() * real).max() < 1e-5
            assert ((mine.values - want.values).abs() * real).max() < 1e-5
        for step in range(8):  # from width 9, across SHORT_ROWS
            token = torch.randint(1, SHAPE["vocab_size"], (len(ids), 1), generator=torch.Generator().manual_seed(step))
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            positions = mask.sum(-1, keepdim=True) - 1
            got = llama_forward.next_logits(model, token, mask, positions, ours)
            want = model(input_ids=token, attention_mask=mask, position_ids=positions, cache=theirs,
                         use_cache=True).logits[:, -1]
            assert got.shape == want.shape and (got - want).abs().max() < 1e-4


@pytest.mark.parametrize("queries", [1, 4])
def test_short_rows_attention_is_eager_even_for_a_row_with_nothing_to_attend_to(queries):
    """The engine's short-row attention against eager's, a row of padding alone included (a prompt of the pad id:
    eager attends uniformly there; it must not be NaN, which the whole batch's sampling would refuse)."""
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(3, 4, n, 16, generator=g) for n in (queries, 9, 9))
    k, v = k[:, :2], v[:, :2]  # grouped-query: 2 key/value heads
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :5] = 0
    mask[2] = 0  # nothing to attend to (at one query: not even itself)
    allowed = llama_forward._allowed(mask, queries)
    with torch.no_grad():
        got = llama_forward._short_rows(allowed, eager=True)(q, k, v, allowed, 0.25)
        want = llama_forward._eager(q, k, v, allowed, 0.25)
    assert torch.isfinite(got).all() and (got - want).abs().max() < 1e-5


@pytest.mark.parametrize("queries", [1, 6])
def test_short_rows_attention_has_the_gradients_of_sdpa_and_none_at_padding(queries):
    """The short-row attention trains (the critic's and the policy's forwards on CPU): its written-out backward
    passes torch's gradient check in float64, agrees with sdpa's (grouped-query heads, padded rows) in float32,
    and sends exactly nothing to a padding key or value (a leaked 1e-35 would still move a frozen-looking
    parameter by Adam's full step)."""
    g = torch.Generator().manual_seed(9)
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[1, :2] = 0
    mask[2, :4] = 0
    allowed = llama_forward._allowed(mask, queries)
    for dtype in (torch.float64, torch.float32):
        q = torch.randn(3, 4, queries, 8, generator=g, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(3, 2, 6, 8, generator=g, dtype=dtype, requires_grad=True) for _ in range(2))
        short = llama_forward._short_rows(allowed, eager=False)
        if dtype == torch.float64:
            assert torch.autograd.gradcheck(lambda *qkv: short(*qkv, allowed, 0.35), (q, k, v))
            continue
        upstream = torch.randn(3, 4, queries, 8, generator=g) * mask[:, None, -queries:, None]  # padding: unread
        got = torch.autograd.grad((short(q, k, v, allowed, 0.35) * upstream).sum(), (q, k, v))
        want = torch.autograd.grad((llama_forward._sdpa(q, k, v, allowed, 0.35) * upstream).sum(), (q, k, v))
        for mine, theirs in zip(got, want):
            assert (mine - theirs).abs().max() < 1e-5
        padding = ~mask.bool()
        assert padding.any() and not got[1].transpose(1, 2)[padding].any() and not got[2].transpose(1, 2)[padding].any()


def test_the_engine_samples_the_same_with_either_forward(tokenizer, tiny_model_dir):
    """Rows join and leave (3 slots, 6 requests of 3 lengths): the same tokens, logprobs to float rounding."""
    from opd_sao.checkpoints import load_causal_lm

    prompts = [tokenizer.encode(text) for text in ("3 + 4 =", "12 + 30 + 5 =", "7 =")]
    requests = [GenerationRequest(list(prompts[i % 3]), SamplingParams(max_new_tokens=3 + 2 * (i % 3),
                                                                      ignore_eos=True)) for i in range(6)]
    results = {}
    for own in (True, False):
        engine = EmbeddedEngine(load_causal_lm(tiny_model_dir), eos_id=tokenizer.eos_token_id,
                                pad_id=tokenizer.pad_token_id, max_batch=3, seed=5, own_forward=own)
        assert engine.own_forward is own
        results[own] = engine.generate_all([copy.deepcopy(r) for r in requests])
    for mine, theirs in zip(results[True], results[False]):
        assert mine.token_ids == theirs.token_ids
        assert torch.allclose(torch.tensor(mine.logprobs), torch.tensor(theirs.logprobs), atol=1e-5)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_the_critic_trains_through_it_as_through_transformers(tiny_model_dir, checkpointed):
    """The same values and the same gradient in every trainable parameter (frozen attention, value head), with
    activation checkpointing on both sides too."""
    ours = ValueModel.from_pretrained(str(tiny_model_dir)).train()
    torch.nn.init.normal_(ours.value_head.weight, generator=torch.Generator().manual_seed(0))
    ours.freeze_attention()
    if checkpointed:
        ours.activation_checkpointing_enable(activation_checkpointing_kwargs=NON_REENTRANT)
    theirs = copy.deepcopy(ours)
    llama_forward.keep_transformers(theirs.backbone)
    assert llama_forward.serves(ours.backbone) and not llama_forward.serves(theirs.backbone)
    ids, mask = _batch(torch.Generator().manual_seed(4), rows=6, width=10, left=False)
    ids = ids % ours.backbone.config.vocab_size
    actions = torch.zeros_like(mask)
    actions[:, 4:] = 1
    actions *= mask
    got, want = ours(ids, mask, actions), theirs(ids, mask, actions)
    assert (got - want).abs().max() < 1e-5
    assert_same_gradients(got, want, ours, theirs, torch.Generator().manual_seed(5), 1e-4)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("width", [9, 20])  # short rows (`_ShortRows`), then the model's own attention kernel
def test_the_policy_trains_through_it_as_through_transformers(attention, width):
    """The trainer's logprobs (`modeling.sequence_logprobs`, the actions only and every position) and every
    parameter's gradient, attention and embeddings included, equal transformers' forward on a copy."""
    from opd_sao.model.modeling import sequence_logprobs

    ours = _model("Qwen2", attention=attention).train()
    theirs = copy.deepcopy(ours)
    llama_forward.keep_transformers(theirs)
    assert llama_forward.serves(ours) and not llama_forward.serves(theirs)
    ids, mask = _batch(torch.Generator().manual_seed(11), rows=6, width=width, left=False)
    only = (torch.arange(width) >= 5).long().expand(6, width) * mask
    for chosen in (only, None):
        got, want = (sequence_logprobs(model, ids, mask, 0.8, only=chosen) for model in (ours, theirs))
        assert got.abs().sum() > 0 and (got - want).abs().max() < 1e-5
        for model in (ours, theirs):
            model.zero_grad()
        assert_same_gradients(got, want, ours, theirs, torch.Generator().manual_seed(12), 1e-4)


def _saved_bytes(model, ids, mask) -> int:
    """Bytes the autograd graph keeps for the backward of the policy's logprobs (what checkpointing trades away):
    each storage once (every checkpointed layer refers to the same rotary tables and mask)."""
    from opd_sao.model.modeling import sequence_logprobs

    saved = {}

    def pack(tensor):
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        sequence_logprobs(model, ids, mask, 1.0).sum().backward()
    return sum(saved.values())


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_activation_checkpointing_runs_through_it_with_transformers_gradients_and_keeps_less(attention):
    """Under activation checkpointing the policy still trains through our forward (it used to fall back to
    transformers'), with the logprobs and gradients of transformers' checkpointed forward, and keeps a fraction of
    the bytes for the backward that it keeps without checkpointing (the layers are recomputed instead): a layer keeps
    its input, as under transformers' checkpointed forward."""
    from opd_sao.model.modeling import sequence_logprobs

    plain = _model("Qwen2", attention=attention).train()
    ours = copy.deepcopy(plain)
    ours.activation_checkpointing_enable(activation_checkpointing_kwargs=NON_REENTRANT)
    theirs = copy.deepcopy(ours)
    llama_forward.keep_transformers(theirs)
    assert llama_forward.serves(ours) and not llama_forward.serves(theirs)
    ids, mask = _batch(torch.Generator().manual_seed(13), rows=6, width=20, left=False)
    got, want = (sequence_logprobs(model, ids, mask, 0.8) for model in (ours, theirs))
    assert got.abs().sum() > 0 and (got - want).abs().max() < 1e-5
    assert_same_gradients(got, want, ours, theirs, torch.Generator().manual_seed(14), 1e-4)
    kept, without = _saved_bytes(ours, ids, mask), _saved_bytes(plain, ids, mask)
    assert kept < 0.5 * without, (kept, without)
    per_layer = {}  # what each further layer keeps: its input alone, as transformers' (by halves it was 3x that)
    for side in ("ours", "theirs"):
        deeper = _model("Qwen2", attention=attention, num_hidden_layers=SHAPE["num_hidden_layers"] + 2).train()
        deeper.activation_checkpointing_enable(activation_checkpointing_kwargs=NON_REENTRANT)
        if side == "theirs":
            llama_forward.keep_transformers(deeper)
        per_layer[side] = (_saved_bytes(deeper, ids, mask) - _saved_bytes(ours if side == "ours" else theirs, ids,
                                                                          mask)) / 2
    assert per_layer["ours"] == per_layer["theirs"] == ids.numel() * SHAPE["hidden_size"] * 4, per_layer


def test_checkpointing_as_the_trainer_enables_it_differentiates_no_frozen_prefix(tiny_model_dir):
    """transformers' activation checkpointing makes the embeddings' output require grad (for adapters under
    reentrant checkpointing), so a critic's frozen layers would be differentiated for nothing; trainers.base.prepare
    removes that hook (its checkpointing is non-reentrant) and still checkpoints."""
    from opd_sao.config import TrainerConfig
    from opd_sao.model.decoders import activation_checkpointing
    from opd_sao.trainers.base import prepare

    seen = []
    for through_prepare in (False, True):
        critic = ValueModel.from_pretrained(tiny_model_dir).train()
        critic.freeze_attention(1)
        if through_prepare:
            prepare(critic, TrainerConfig(gradient_checkpointing=True))
        else:
            critic.activation_checkpointing_enable(activation_checkpointing_kwargs=NON_REENTRANT)
        assert activation_checkpointing(critic.backbone)
        hook = critic.backbone.embed_tokens.register_forward_hook(lambda m, i, out: seen.append(out.requires_grad))
        ids, mask = _batch(torch.Generator().manual_seed(8), rows=3, width=10, left=False)
        critic(ids % critic.backbone.config.vocab_size, mask).sum().backward()
        hook.remove()
    assert seen == [True, False]


@pytest.mark.parametrize("top_layers,checkpointed", [(None, False), (1, False), (1, True)])
def test_a_steps_critic_forwards_reuse_the_frozen_start_exactly(tiny_model_dir, top_layers, checkpointed):
    """Within `reusing_frozen_start`, a later forward over the same rows starts from the first one's state before
    the feed-forward block of the deepest layer everything frozen precedes (layer 0 under frozen attention, the
    last layer when only it trains): after an update of the trained blocks, its values and gradients are those of
    a forward from scratch, bit for bit; other rows (another mask) get their own; a critic whose attention trains
    keeps nothing. Under activation checkpointing too (the trained layers recomputed in the backward)."""
    critic = ValueModel.from_pretrained(tiny_model_dir).train()
    critic.freeze_attention(top_layers)
    if checkpointed:
        critic.activation_checkpointing_enable(activation_checkpointing_kwargs=NON_REENTRANT)
    layers = critic.backbone.config.num_hidden_layers
    assert layers >= 2  # else both cases start at layer 0
    torch.nn.init.normal_(critic.value_head.weight, generator=torch.Generator().manual_seed(7))  # not zero: trains
    ids, mask = _batch(torch.Generator().manual_seed(6), rows=6, width=10, left=False)
    ids = ids % critic.backbone.config.vocab_size
    actions = (torch.arange(10) >= 4).long().expand(6, 10) * mask
    other = mask.clone()
    other[0, :2] = 0  # the same ids and actions, another mask: two of row 0's prompt tokens are padding
    optimizer = torch.optim.SGD([p for p in critic.parameters() if p.requires_grad], lr=0.5)

    def fresh(attention_mask):  # a whole backward, as the learner's: one that reached an earlier forward's graph
        # through the kept start (built when an input requires grad: transformers' checkpointing hook) would fail
        critic.zero_grad()
        values = critic(ids, attention_mask, actions * attention_mask)
        values.square().sum().backward()
        return values.detach(), [p.grad.clone() for p in critic.parameters() if p.requires_grad]

    with critic.reusing_frozen_start():
        critic(ids, mask, actions).square().sum().backward()  # the first forward keeps its start
        optimizer.step()
        assert len(critic._starts.kept) == 1
        assert critic._starts.kept[0][3]["layer"] == (0 if top_layers is None else layers - top_layers)
        later, other_rows = fresh(mask), fresh(other)
        assert len(critic._starts.kept) == 2  # the other mask got its own
    assert critic._starts is None
    for (values, grads), want in ((later, fresh(mask)), (other_rows, fresh(other))):
        assert torch.equal(values, want[0]) and all(torch.equal(a, b) for a, b in zip(grads, want[1]))
    assert not torch.equal(later[0], other_rows[0])
    # a later forward really starts there: a frozen weight before the start, changed, is not seen within the scope
    layer0 = critic.backbone.layers[0]
    before_start = layer0.self_attn.q_proj.weight if top_layers is None else layer0.mlp.up_proj.weight
    with critic.reusing_frozen_start():
        first = critic(ids, mask, actions).detach()
        with torch.no_grad():
            before_start.add_(1.0)
        assert torch.equal(critic(ids, mask, actions).detach(), first)
    assert not torch.equal(critic(ids, mask, actions).detach(), first)  # outside it, computed anew
    for p in critic.parameters():
        p.requires_grad_(True)
    with critic.reusing_frozen_start():
        critic(ids, mask, actions)
        assert not critic._starts.kept  # attention trains: nothing before the feed-forward block is fixed


def test_other_models_keep_transformers_forward():
    windowed = _model("Mistral", sliding_window=4)
    assert "windowed" in llama_forward.unsupported(windowed)
    flash = _model("Llama")
    flash.config._attn_implementation = "flash_attention_2"
    assert "flash_attention_2" in llama_forward.unsupported(flash)
    phi = transformers.Phi3ForCausalLM(transformers.Phi3Config(**SHAPE))
    assert "Phi3Model" in llama_forward.unsupported(phi)
    engine = EmbeddedEngine(windowed, eos_id=None, pad_id=0)
    assert not engine.own_forward


@pytest.mark.parametrize("own", [True, False, None])
def test_trainer_own_forward_chooses_the_policys_and_the_critics_forward(tiny_model_dir, own):
    """Unset (the default), a trainer on CPU runs ours, as it did before the setting became auto."""
    from opd_sao.config import TrainerConfig
    from opd_sao.trainers import TorchTrainer

    cfg = TrainerConfig(device="cpu") if own is None else TrainerConfig(device="cpu", own_forward=own)
    trainer = TorchTrainer(tiny_model_dir, cfg, with_critic=True)
    expected = own is not False
    assert llama_forward.serves(trainer.policy) is expected
    assert llama_forward.serves(trainer.critic.backbone) is expected


def test_own_forward_unset_is_ours_on_cpu_only_and_a_set_value_wins():
    """Ours is measured faster on CPU (docs/benchmarks.md); elsewhere transformers' until gpu_check measures it."""
    for device in ("cpu", torch.device("cpu")):
        assert llama_forward.own_forward_on(device) and llama_forward.own_forward_on(device, None)
    for device in ("cuda", "cuda:1", torch.device("cuda", 0), "mps", "xpu"):
        assert not llama_forward.own_forward_on(device)
        assert llama_forward.own_forward_on(device, True)
    assert not llama_forward.own_forward_on("cpu", False)


@pytest.mark.parametrize("own", [True, False, None])
def test_off_cpu_a_model_runs_ours_only_when_opted_in(own):
    """Teachers, evaluation and the gate's scoring ask `serves` with no setting of their own: auto, ours on CPU
    only; `own_forward: true` opts a model in on any device (`use_own`, called by the trainer's `prepare` and the
    engine). `meta` stands in for a GPU: parameters there have a device but no data."""
    from opd_sao.config import TrainerConfig
    from opd_sao.trainers.base import prepare

    on_cpu, elsewhere = _model("Qwen2"), _model("Qwen2").to("meta")
    assert llama_forward.serves(on_cpu) and not llama_forward.serves(elsewhere)
    cfg = TrainerConfig() if own is None else TrainerConfig(own_forward=own)
    trained = prepare(_model("Qwen2").to("meta"), cfg)
    assert llama_forward.serves(trained) is (own is True)
    llama_forward.use_own(elsewhere)
    assert llama_forward.serves(elsewhere)


def test_an_engine_on_cpu_runs_ours_unless_told_not_to(tiny_model_dir, tokenizer):
    from opd_sao.checkpoints import load_causal_lm

    def engine(**own):
        return EmbeddedEngine(load_causal_lm(tiny_model_dir), eos_id=tokenizer.eos_token_id,
                              pad_id=tokenizer.pad_token_id, **own)

    assert engine().own_forward and not engine(own_forward=False).own_forward


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_unset_keeps_transformers_forward_until_gpu_check_has_measured_ours(tiny_model_dir, tokenizer):
    from opd_sao.checkpoints import load_causal_lm
    from opd_sao.config import TrainerConfig
    from opd_sao.trainers import TorchTrainer

    for own, expected in ((None, False), (True, True)):
        cfg = TrainerConfig(device="cuda") if own is None else TrainerConfig(device="cuda", own_forward=own)
        trainer = TorchTrainer(tiny_model_dir, cfg, with_critic=True)
        assert llama_forward.serves(trainer.policy) is expected
        assert llama_forward.serves(trainer.critic.backbone) is expected
        engine = EmbeddedEngine(load_causal_lm(tiny_model_dir, device=torch.device("cuda")),
                                eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, own_forward=own)
        assert engine.own_forward is expected
        assert llama_forward.serves(engine.model) is expected  # deterministic mode's rescoring
    assert not llama_forward.serves(load_causal_lm(tiny_model_dir, device=torch.device("cuda")))  # a teacher's
