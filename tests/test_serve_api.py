"""`opd-sao serve` as SGLang 0.5.23 behaves, over real HTTP on loopback: logprob and scoring semantics (checked
against the model in this process and against SGLang's own position code from its wheel), greedy / top_k /
stop / skip_special_tokens, the OpenAI-compatible routes (the judge reward through them), weight-update
sessions, the admin key and --weights-root, health after failing generations, and hostile fields.
"""
from __future__ import annotations

import importlib.util
import itertools
import json
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import requests
import sglang_code
import torch
from launchers import wait_until_healthy


@pytest.fixture(scope="module")
def server(tiny_model_dir, start_server):
    url, proc = start_server(tiny_model_dir, "--max-batch", 4)
    wait_until_healthy(url, lambda: proc.poll() is None)
    yield url
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from opd_sao.checkpoints import load_causal_lm

    return load_causal_lm(tiny_model_dir)


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return [tokenizer.bos_token_id] + tokenizer.encode("12+7=", add_special_tokens=False)


@pytest.fixture(scope="module")
def chat_model_dir(tiny_model_dir, tokenizer, tmp_path_factory):
    """The tiny model with larger weights: its greedy continuations vary, as a trained model's do (at init
    they repeat one token)."""
    from opd_sao.checkpoints import load_causal_lm, save_checkpoint

    peaked = load_causal_lm(tiny_model_dir)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in peaked.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    return Path(save_checkpoint(peaked, tokenizer, tmp_path_factory.mktemp("chat") / "tiny-chat"))


@pytest.fixture(scope="module")
def chat_model(chat_model_dir):
    from opd_sao.checkpoints import load_causal_lm

    return load_causal_lm(chat_model_dir)


@pytest.fixture(scope="module")
def chat_server(chat_model_dir, start_server):
    url, proc = start_server(chat_model_dir, "--max-batch", 4)
    wait_until_healthy(url, lambda: proc.poll() is None)
    yield url
    proc.kill()
    proc.wait()


def _post(url, path, body, **kw):
    return requests.post(url + path, data=json.dumps(body), headers={"Content-Type": "application/json"},
                         timeout=60, **kw)


def _strict_json(response):
    """The body as JSON that a strict parser accepts (no bare NaN or Infinity)."""
    def refuse(constant):
        raise ValueError(f"bare {constant} in the body")

    return json.loads(response.text, parse_constant=refuse)


@torch.no_grad()
def _logp(model, ids, temperature=1.0):
    x = torch.tensor([ids])
    return torch.log_softmax(model(x).logits[0].float() / temperature, -1)


# --- scoring and logprob semantics --------------------------------------------------------------------------

@pytest.mark.parametrize("start", [0, 2, 5])
@pytest.mark.skipif(not sglang_code.installed(), reason="sglang is not installed (scripts/setup.sh installs it)")
def test_scoring_has_sglangs_positions(server, model, prompt, start):
    """input_token_logprobs[j] = [logprob of token start+j given the tokens before it, that token, null], entry 0
    None whatever the start, as SGLang's own position code (its scheduler's _process_input_token_logprobs, from
    the wheel) turns its raw values into; top-k the same shape."""
    ids = prompt + [5, 6, 7]
    answer = _post(server, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
                                         "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": 3})
    assert answer.status_code == 200, answer.text
    meta = _strict_json(answer)["meta_info"]
    logp = _logp(model, ids)
    served = meta["input_token_logprobs"]
    assert [e[1] for e in served] == ids[start:] and served[0][0] is None
    expected = [float(logp[p - 1, ids[p]]) for p in range(start + 1, len(ids))]
    assert torch.allclose(torch.tensor([e[0] for e in served[1:]]), torch.tensor(expected), atol=1e-5)
    raw = [float(logp[p, ids[p + 1]]) for p in range(start, len(ids) - 1)] + [0.0]  # + the sampled token's
    values, tokens = sglang_code.process_input_token_logprobs(raw, ids, start, logp.shape[-1])
    assert tokens == [e[1] for e in served] and values[0] is None and served[0][0] is None
    assert torch.allclose(torch.tensor(values[1:]), torch.tensor([e[0] for e in served[1:]]), atol=1e-5)
    tops = meta["input_top_logprobs"]
    assert len(tops) == len(served) and tops[0] is None
    assert [t[1] for t in tops[1]] == logp[start].topk(3).indices.tolist()
    assert meta["output_token_logprobs"] == [] and meta["finish_reason"] == {"type": "length", "length": 0}


def test_logprob_start_len_bounds_as_sglang(server, prompt):
    """-1: no prompt positions; the prompt's length: none either; past it: 400 (SGLang aborts it)."""
    for start in (-1, len(prompt)):
        meta = _post(server, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 0},
                                           "return_logprob": True, "logprob_start_len": start}).json()["meta_info"]
        assert meta["input_token_logprobs"] == []
    over = _post(server, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 0},
                                       "return_logprob": True, "logprob_start_len": len(prompt) + 1})
    assert over.status_code == 400 and "logprob_start_len" in over.json()["error"]["message"]


def test_the_clients_score_reads_sglangs_positions(server, model, prompt):
    from opd_sao.engines.http import SGLangClient

    ids = prompt + [5, 6, 7]
    scores = SGLangClient(server).score(ids, start=1, top_k=2)
    logp = _logp(model, ids)
    assert torch.allclose(torch.tensor(scores.token_logprobs),
                          torch.tensor([float(logp[p - 1, ids[p]]) for p in range(1, len(ids))]), atol=1e-5)
    assert scores.top_ids[0] == logp[0].topk(2).indices.tolist() and len(scores.top_ids) == len(ids) - 1


def test_output_logprobs_are_over_the_whole_vocabulary_unless_the_sampling_mask_is_asked(server, model, prompt):
    """top_p 0.5 at T 0.7: output_token_logprobs are log softmax(logits / T) over the whole vocabulary;
    return_sampling_mask adds output_token_sampling_logprobs, renormalised to the nucleus (larger)."""
    from opd_sao.model.modeling import nucleus_logprobs

    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0.7, "top_p": 0.5,
                                                     "ignore_eos": True},
            "return_logprob": True, "return_sampling_mask": True}
    answer = _post(server, "/generate", body).json()
    out, meta = answer["output_ids"], answer["meta_info"]
    logits = torch.log_softmax(_logp(model, prompt + out), -1)[len(prompt) - 1:-1]  # T=1 logprobs = logits + c
    full = torch.log_softmax(logits / 0.7, -1)
    nucleus = nucleus_logprobs(logits, torch.full((len(out),), 0.7), torch.full((len(out),), 0.5))
    index = torch.tensor(out)[:, None]
    vocab = torch.tensor([e[0] for e in meta["output_token_logprobs"]])
    sampled = torch.tensor(meta["output_token_sampling_logprobs"])
    assert torch.allclose(vocab, full.gather(1, index)[:, 0], atol=1e-4)
    assert torch.allclose(sampled, nucleus.gather(1, index)[:, 0], atol=1e-4)
    assert bool((sampled > vocab + 1e-3).all())  # a nucleus of mass ~0.5: every one renormalised up
    plain = _post(server, "/generate", {**body, "return_sampling_mask": False}).json()["meta_info"]
    assert "output_token_sampling_logprobs" not in plain


def test_top_logprobs_of_generated_tokens(server, model, prompt):
    """output_top_logprobs: per generated token, the k best of log softmax(logits / T) at its position."""
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 5, "temperature": 0.7, "ignore_eos": True},
            "return_logprob": True, "top_logprobs_num": 3, "return_text_in_logprobs": True}
    meta = _post(server, "/generate", body).json()
    out, tops = meta["output_ids"], meta["meta_info"]["output_top_logprobs"]
    logp = torch.log_softmax(_logp(model, prompt + out)[len(prompt) - 1:-1] / 0.7, -1)  # logits + c, / T
    expected = logp.topk(3)
    assert len(tops) == len(out) and all(len(t) == 3 for t in tops)
    assert [[e[1] for e in t] for t in tops] == expected.indices.tolist()
    assert torch.allclose(torch.tensor([[e[0] for e in t] for t in tops]), expected.values, atol=1e-4)
    assert all(isinstance(e[2], str) for t in tops for e in t)


# --- greedy, top_k, stop, skip_special_tokens ---------------------------------------------------------------

def _greedy_continuation(model, ids, n):
    out = []
    for _ in range(n):
        out.append(int(_logp(model, ids + out)[-1].argmax()))
    return out


def test_greedy_is_the_argmax_with_temperature_one_logprobs(server, model, prompt):
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
            "return_logprob": True}
    first, second = (_post(server, "/generate", body).json() for _ in range(2))
    expected = _greedy_continuation(model, prompt, 6)
    assert first["output_ids"] == second["output_ids"] == expected
    logp = _logp(model, prompt + expected)[len(prompt) - 1:-1]
    assert torch.allclose(torch.tensor([e[0] for e in first["meta_info"]["output_token_logprobs"]]),
                          logp.gather(1, torch.tensor(expected)[:, None])[:, 0], atol=1e-4)
    top1 = _post(server, "/generate", {**body, "sampling_params": {**body["sampling_params"], "temperature": 1.0,
                                                                   "top_k": 1}}).json()
    assert top1["output_ids"] == expected


def test_top_k_samples_among_the_k_best(server, model, prompt):
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 12, "top_k": 3, "ignore_eos": True},
            "return_logprob": True, "return_sampling_mask": True}
    answer = _post(server, "/generate", body).json()
    out = answer["output_ids"]
    logp = _logp(model, prompt + out)[len(prompt) - 1:-1]
    top3 = logp.topk(3)
    for i, token in enumerate(out):
        assert token in top3.indices[i].tolist()
    sampled = torch.tensor(answer["meta_info"]["output_token_sampling_logprobs"])
    expected = logp.gather(1, torch.tensor(out)[:, None])[:, 0] - torch.logsumexp(top3.values, -1)
    assert torch.allclose(sampled, expected, atol=1e-4)


def test_a_sampling_seed_fixes_the_draws_whatever_else_is_in_the_batch(server, prompt):
    """SGLang's sampling_seed (honoured there under --enable-deterministic-inference): the same seed gives the same
    tokens alone or in a batch with other prompts; another seed gives others (8 tokens of 4 answers at T 1.5)."""
    params = {"max_new_tokens": 8, "temperature": 1.5, "ignore_eos": True}
    alone = _post(server, "/generate", {"input_ids": prompt, "sampling_params": {**params, "sampling_seed": 3}}).json()
    batch = _post(server, "/generate", {"input_ids": [prompt[1:], prompt, prompt, prompt[:-1]], "sampling_params": [
        {**params, "sampling_seed": s} for s in (9, 3, 4, 5)]}).json()
    assert batch[1]["output_ids"] == alone["output_ids"]
    assert any(b["output_ids"] != alone["output_ids"] for b in batch[2:])
    bad = _post(server, "/generate", {"input_ids": prompt, "sampling_params": {"sampling_seed": 2 ** 63}})
    assert bad.status_code == 400 and "sampling_seed" in _strict_json(bad)["error"]["message"]


def test_stop_token_ids_and_stop_strings_end_the_output(chat_server, chat_model, tokenizer):
    """A prompt whose greedy continuation (found with the model here) has a new, plain-text token at a
    position >= 2: it stops the output as a stop token id, then as a stop string."""
    greedy = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": False}
    server, model = chat_server, chat_model
    for a in range(40):
        prompt = [tokenizer.bos_token_id] + tokenizer.encode(f"{a}*{a}=", add_special_tokens=False)
        out = _greedy_continuation(model, prompt, 10)
        new = [i for i in range(2, 10) if out[i] not in out[:i] and tokenizer.decode([out[i]]).strip().isalnum()]
        if tokenizer.eos_token_id not in out and new:
            break
    stop_at = new[0]
    answer = _post(server, "/generate", {"input_ids": prompt, "sampling_params": {
        **greedy, "stop_token_ids": [out[stop_at]]}}).json()
    assert answer["output_ids"] == out[:stop_at + 1]
    assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": out[stop_at]}

    text = tokenizer.decode(out)
    i, piece = next((i, tokenizer.decode([out[i]]).strip()) for i in new
                    if text.find(tokenizer.decode([out[i]]).strip()) >= len(tokenizer.decode(out[:i])))
    answer = _post(server, "/generate", {"input_ids": prompt, "sampling_params": {**greedy, "stop": [piece]}}).json()
    assert answer["output_ids"] == out[:i + 1]
    assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": piece}
    assert answer["text"] == text[:text.find(piece)]
    kept = _post(server, "/generate", {"input_ids": prompt, "sampling_params": {
        **greedy, "stop": piece, "no_stop_trim": True}}).json()
    assert kept["text"].endswith(piece) and kept["output_ids"] == out[:i + 1]


def test_skip_special_tokens_is_honoured(chat_server, chat_model, tokenizer):
    """A prompt whose greedy next token is eos (found with the model here): with SGLang's default
    (skip_special_tokens true) the text leaves it out; false keeps it."""
    eos = tokenizer.eos_token_id
    candidates = ([tokenizer.bos_token_id, a] for a in range(3, len(tokenizer)))
    server, model = chat_server, chat_model
    ids = next((c for c in candidates if int(_logp(model, c)[-1].argmax()) == eos), None)
    assert ids is not None, "no one-token prompt makes the tiny model predict eos"
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    skipped = _post(server, "/generate", body).json()
    assert skipped["output_ids"] == [eos] and skipped["text"] == ""
    assert skipped["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    kept = _post(server, "/generate", {**body, "sampling_params": {**body["sampling_params"],
                                                                   "skip_special_tokens": False}}).json()
    assert kept["text"] == tokenizer.eos_token


# --- OpenAI-compatible routes ---------------------------------------------------------------------------------

def _chat_ids(model_dir, content: str) -> list[int]:
    """One user message through the served tokenizer's chat template, as serve applies it."""
    from opd_sao.checkpoints import load_tokenizer

    ids = load_tokenizer(model_dir).apply_chat_template([{"role": "user", "content": content}],
                                                       add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_openai_completions_and_chat(chat_server, chat_model_dir, chat_model, tokenizer):
    import openai

    client = openai.OpenAI(base_url=chat_server + "/v1", api_key="EMPTY", max_retries=0)
    assert [m.id for m in client.models.list().data] == [str(chat_model_dir)]
    as_text = tokenizer.encode("12+7=")  # a text prompt is tokenized with the tokenizer's defaults, as SGLang
    expected = tokenizer.decode(_greedy_continuation(chat_model, as_text, 5))
    done = client.completions.create(model="any", prompt="12+7=", max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.choices[0].text == expected and done.usage.completion_tokens == 5
    assert done.choices[0].finish_reason == "length" and done.usage.prompt_tokens == len(as_text)
    templated = _chat_ids(chat_model_dir, "12+7=")
    expected = tokenizer.decode(_greedy_continuation(chat_model, templated, 5))
    chat = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "12+7="}],
                                          max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == expected and chat.usage.prompt_tokens == len(templated)
    streaming = _post(chat_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                            "stream": True})
    assert streaming.status_code == 400 and "stream" in streaming.json()["error"]["message"]


def test_the_judge_reward_scores_through_serves_chat_route(chat_server, chat_model_dir, chat_model, tokenizer):
    """The judge (the openai client) asks serve's /v1/chat/completions: its score is the first number of the
    greedy reply this process computes (none: the judgement fails and scores 0)."""
    from opd_sao.envs.dataset.rewards import JudgeReward

    out = _greedy_continuation(chat_model, _chat_ids(chat_model_dir, "7"), 16)
    out = out[:out.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in out else out
    match = re.search(r"-?\d+(?:\.\d+)?", tokenizer.decode(out, skip_special_tokens=True))
    judge = JudgeReward(chat_server + "/v1", "tiny", template="{response}", max_score=1000.0, retries=0,
                        on_failure="zero", max_tokens=16)
    verdict = judge.score({"id": "t", "prompt": "p"}, "7")
    assert judge.stats()["requests"] == 1
    if match is None:
        assert verdict.score == 0.0 and judge.stats()["failed_judgements"] == 1
    else:
        assert verdict.score == min(1.0, max(0.0, float(match.group(0)) / 1000.0))
        assert judge.stats()["failed_judgements"] == 0


# --- weight-update sessions ---------------------------------------------------------------------------------

def test_tensor_and_distributed_updates_need_a_session_disk_does_not(server, tiny_model_dir):
    """SGLang 0.5.23: update_weights_from_tensor / _distributed answer 400 outside begin/end; a second begin
    and an end without begin are 400 too; update_weights_from_disk runs any time."""
    from opd_sao.checkpoints import load_causal_lm
    from opd_sao.engines.weight_sync import untied
    from opd_sao.engines.weight_sync.tensor import serialize

    packed = serialize(list(untied(load_causal_lm(tiny_model_dir).state_dict()).items()), "flattened_bucket")
    tensor = {"serialized_named_tensors": [packed], "load_format": "flattened_bucket", "weight_version": "5"}
    outside = _post(server, "/update_weights_from_tensor", tensor)
    assert outside.status_code == 400 and "begin_weight_update" in outside.json()["message"]
    assert _post(server, "/end_weight_update", {}).status_code == 400
    assert _post(server, "/begin_weight_update", {}).json() == {"success": True, "message": "Success"}
    assert _post(server, "/begin_weight_update", {}).status_code == 400
    inside = _post(server, "/update_weights_from_tensor", tensor)
    assert inside.status_code == 200 and inside.json()["success"], inside.text
    assert _post(server, "/end_weight_update", {}).json()["success"]
    assert requests.get(server + "/model_info", timeout=10).json()["weight_version"] == "5"
    disk = _post(server, "/update_weights_from_disk", {"model_path": str(tiny_model_dir), "weight_version": "0"})
    assert disk.status_code == 200 and disk.json()["success"]
    assert requests.get(server + "/get_model_info", timeout=10).json()["weight_version"] == "0"


# --- hostile fields -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("path,body,named", [
    ("/update_weights_from_disk", {"model_path": "m" * 10_000}, "model_path"),
    ("/update_weights_from_disk", {"model_path": "/tmp/x\u0000y"}, "model_path"),
    ("/update_weights_from_disk", {"model_path": "TINY", "weight_version": "\u00b2"}, "weight_version"),
    ("/update_weights_from_disk", {"model_path": 5}, "model_path"),
    ("/update_weights_from_disk", {"model_path": "/etc"}, "--weights-root"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 70000, "rank_offset": 1,
                                    "world_size": 2}, "master_port"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 2,
                                    "world_size": 2, "backend": "gloo"}, "rank_offset"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": "x"}, "serialized_named_tensors"),
    ("/update_weights_from_distributed", {"group_name": 5}, "group_name"),
    ("/destroy_weights_update_group", {"group_name": ["a"]}, "group_name"),
    ("/begin_weight_update", {"selector": "draft"}, "selector"),
], ids=["path-10000", "path-nul", "version-superscript", "path-int", "outside-root", "port-70000",
        "rank-past-world", "tensors-str", "group-str", "group-list", "selector-draft"])
def test_a_malformed_weight_field_is_a_400(server, tiny_model_dir, prompt, path, body, named):
    """Inside a weight-update session (tensor and distributed updates check for one first, as SGLang)."""
    body = {k: str(tiny_model_dir) if v == "TINY" else v for k, v in body.items()}
    assert _post(server, "/begin_weight_update", {}).json()["success"]
    bad = _post(server, path, body)
    assert _post(server, "/end_weight_update", {}).json()["success"]
    assert bad.status_code == 400, bad.text
    answer = _strict_json(bad)
    assert answer["success"] is False and named in answer["message"], answer
    ok = _post(server, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200


@pytest.mark.parametrize("path,body,named", [
    ("/generate", {"input_ids": "P", "rid": {"a": 1}}, "rid"),
    ("/generate", {"input_ids": "P", "stream": True}, "stream"),
    ("/generate", {"input_ids": "P", "sampling_logprobs_mode": "support"}, "sampling_logprobs_mode"),
    ("/generate", {"input_ids": "P", "sampling_params": {"stop": 5}}, "stop"),
    ("/generate", {"input_ids": "P", "sampling_params": {"top_k": 2.5}}, "top_k"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "role"),
], ids=["rid-object", "stream", "support-mode", "stop-int", "top_k-float", "prompt-int", "max_tokens-negative",
        "no-messages", "role"])
def test_a_malformed_generation_field_is_a_400(server, prompt, path, body, named):
    body = {k: prompt if v == "P" else v for k, v in body.items()}
    bad = _post(server, path, body)
    assert bad.status_code == 400 and named in _strict_json(bad)["error"]["message"], bad.text


# --- health and JSON after failing generations --------------------------------------------------------------

def test_a_server_whose_generation_fails_is_unhealthy_until_it_recovers(server, tiny_model_dir, prompt, tmp_path):
    """Weights that overflow the logits (finite: the final norm's scale 3e38, so logits of +-inf and NaN
    probabilities): generation and scoring fail with a 500 whose body is valid JSON, /health turns 503; the good
    weights back, 200 again."""
    from opd_sao.checkpoints import load_causal_lm, load_tokenizer, save_checkpoint

    broken = load_causal_lm(tiny_model_dir)
    with torch.no_grad():
        broken.model.norm.weight.fill_(3e38)
    path = save_checkpoint(broken, load_tokenizer(tiny_model_dir), tmp_path / "overflowing")
    assert _post(server, "/update_weights_from_disk", {"model_path": str(path), "weight_version": "1"}).json()["success"]
    generation = _post(server, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}})
    assert generation.status_code == 500 and _strict_json(generation)["error"]["message"]
    assert requests.get(server + "/health", timeout=30).status_code == 503
    scoring = _post(server, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 0},
                                          "return_logprob": True, "logprob_start_len": 0})
    assert scoring.status_code == 500 and "not finite" in _strict_json(scoring)["error"]["message"]
    assert requests.get(server + "/health_generate", timeout=30).status_code == 503
    restored = _post(server, "/update_weights_from_disk", {"model_path": str(tiny_model_dir), "weight_version": "0"})
    assert restored.json()["success"]
    assert requests.get(server + "/health", timeout=30).status_code == 200
    assert _post(server, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}}).status_code == 200


# --- who may update weights -----------------------------------------------------------------------------------

def _non_loopback_address() -> str:
    """An address of this machine that is not loopback (a connection to it comes from it, not 127.0.0.1)."""
    try:
        listed = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError):
        listed = []
    listed += [info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
    for address in listed:
        if "." in address and not address.startswith("127."):
            return address
    pytest.skip("this machine has no non-loopback IPv4 address to call serve from")


@pytest.fixture(scope="module")
def weights_root(tiny_model_dir, tmp_path_factory):
    """A --weights-root holding a copy of the tiny model and a symlink to the original (outside the root)."""
    root = tmp_path_factory.mktemp("weights-root")
    shutil.copytree(tiny_model_dir, root / "copy")
    (root / "link").symlink_to(tiny_model_dir, target_is_directory=True)
    return root


@pytest.fixture(scope="module")
def open_server(tiny_model_dir, start_server, weights_root):
    """serve on every interface (0.0.0.0), started without an admin key."""
    url, proc = start_server(tiny_model_dir, "--host", "0.0.0.0", "--weights-root", weights_root)
    wait_until_healthy(url, lambda: proc.poll() is None)
    yield url
    proc.kill()
    proc.wait()


def test_serve_without_an_admin_key_refuses_weight_updates_from_a_non_loopback_client(
        open_server, weights_root, prompt):
    """The caller's address is the TCP peer's: 192.0.2.x calling its own interface is not loopback, so every
    weight route is 403 from there (the model is unchanged), while 127.0.0.1 may update and /generate is open
    to both."""
    port = open_server.rsplit(":", 1)[1]
    remote = f"http://{_non_loopback_address()}:{port}"
    update = {"model_path": str(weights_root / "copy"), "weight_version": "7"}
    for path, body in [("/update_weights_from_disk", update), ("/begin_weight_update", {}), ("/flush_cache", {}),
                       ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                       "rank_offset": 1, "world_size": 2})]:
        refused = _post(remote, path, body)
        assert refused.status_code == 403 and refused.json()["error"] == "Forbidden" \
            and "--admin-api-key" in refused.json()["message"], refused.text
    assert requests.get(remote + "/model_info", timeout=10).json()["weight_version"] == "default"
    assert _post(remote, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}}).status_code == 200
    local = _post(open_server, "/update_weights_from_disk", update)
    assert local.status_code == 200 and local.json()["success"], local.text
    assert requests.get(remote + "/model_info", timeout=10).json()["weight_version"] == "7"


def test_model_paths_only_under_the_weights_root_symlinks_resolved(open_server, weights_root, tiny_model_dir):
    through_link = _post(open_server, "/update_weights_from_disk", {"model_path": str(weights_root / "link")})
    assert through_link.status_code == 400 and "--weights-root" in through_link.json()["message"]
    outside = _post(open_server, "/update_weights_from_disk", {"model_path": str(tiny_model_dir)})
    assert outside.status_code == 400 and "--weights-root" in outside.json()["message"]
    escape = _post(open_server, "/update_weights_from_disk", {"model_path": str(weights_root / "copy" / ".." / "..")})
    assert escape.status_code == 400 and "--weights-root" in escape.json()["message"]


def test_with_an_admin_key_weight_routes_need_it_from_everywhere(tiny_model_dir, start_server, prompt):
    url, proc = start_server(tiny_model_dir, "--host", "0.0.0.0", "--admin-api-key", "s3cret")
    wait_until_healthy(url, lambda: proc.poll() is None)
    remote = url.replace("127.0.0.1", _non_loopback_address())
    update = {"model_path": str(tiny_model_dir), "weight_version": "3"}
    for base in (url, remote):
        assert _post(base, "/update_weights_from_disk", update).status_code == 401
        assert requests.post(base + "/update_weights_from_disk", json=update, timeout=60,
                             headers={"Authorization": "Bearer wrong"}).status_code == 401
    keyed = requests.post(remote + "/update_weights_from_disk", json=update, timeout=60,
                          headers={"Authorization": "Bearer s3cret"})
    assert keyed.status_code == 200 and keyed.json()["success"], keyed.text
    assert _post(remote, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}}).status_code == 200
    assert requests.get(remote + "/health", timeout=10).status_code == 200
    proc.kill()
    proc.wait()


def _sglang_auth_module():
    """SGLang 0.5.23's sglang/srt/utils/auth.py from the installed wheel (a module without torch imports),
    loaded by file so the package's __init__ (CUDA-era imports) is not run."""
    spec = importlib.util.find_spec("sglang")
    if spec is None:
        pytest.skip("sglang is not installed (pip install --no-deps sglang==0.5.23)")
    path = Path(spec.origin).parent / "srt" / "utils" / "auth.py"
    module_spec = importlib.util.spec_from_file_location("sglang_auth", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules["sglang_auth"] = module  # its dataclasses look their module up
    module_spec.loader.exec_module(module)
    return module


def test_key_decisions_are_sglangs_and_stricter_only_without_keys_off_loopback():
    """admin_decision against SGLang's own decide_request_auth over every route kind, key setting and
    header: equal, except that with no key at all a weight route from a non-loopback client is refused."""
    from opd_sao.engines.server import admin_decision

    auth = _sglang_auth_module()
    paths = {"/generate": auth.AuthLevel.NORMAL, "/v1/chat/completions": auth.AuthLevel.NORMAL,
             "/health": auth.AuthLevel.NORMAL, "/update_weights_from_disk": auth.AuthLevel.ADMIN_OPTIONAL,
             "/update_weights_from_tensor": auth.AuthLevel.ADMIN_OPTIONAL,
             "/begin_weight_update": auth.AuthLevel.ADMIN_OPTIONAL, "/flush_cache": auth.AuthLevel.ADMIN_OPTIONAL,
             "/pause_generation": auth.AuthLevel.ADMIN_OPTIONAL, "/continue_generation": auth.AuthLevel.ADMIN_OPTIONAL,
             "/abort_request": auth.AuthLevel.ADMIN_OPTIONAL,
             "/model_info": auth.AuthLevel.NORMAL}
    keys = [(None, None), ("user", None), (None, "admin"), ("user", "admin")]
    headers = [None, "Bearer user", "Bearer admin", "bearer admin", "Bearer wrong", "Basic admin"]
    compared = 0
    for (path, level), (api_key, admin_key), header, host in itertools.product(
            paths.items(), keys, headers, ["127.0.0.1", "::1", "192.0.2.2", "::ffff:127.0.0.1", "10.1.2.3"]):
        ours = admin_decision(path, header, host, api_key=api_key, admin_api_key=admin_key)
        theirs = auth.decide_request_auth(method="POST", path=path, authorization_header=header, api_key=api_key,
                                          admin_api_key=admin_key, auth_level=level)
        stricter = level == auth.AuthLevel.ADMIN_OPTIONAL and api_key is None and admin_key is None \
            and host in ("192.0.2.2", "10.1.2.3")
        if stricter:
            assert ours == 403 and theirs.allowed
        else:
            assert (ours is None) == theirs.allowed, (path, api_key, admin_key, header, host)
            compared += 1
    assert compared > 800


def test_the_trainers_engine_syncs_weights_through_the_keys(tiny_model_dir, tokenizer, start_server, prompt):
    """serve with both keys, called from a non-loopback address: the fleet engine given the keys (config
    fields) generates and syncs weights (disk); without them its first call is refused."""
    from opd_sao.config import EngineConfig
    from opd_sao.engines import build_engine
    from opd_sao.engines.base import GenerationRequest, SamplingParams
    from opd_sao.engines.http import ServerError

    url, proc = start_server(tiny_model_dir, "--host", "0.0.0.0", "--api-key", "user", "--admin-api-key", "admin")
    remote = url.replace("127.0.0.1", _non_loopback_address())
    try:
        wait_until_healthy(url, lambda: proc.poll() is None)  # /health needs no key
        assert _post(remote, "/generate", {"input_ids": prompt}).status_code == 401  # every route needs the API key
        engine = build_engine(EngineConfig(kind="http", urls=[remote], max_batch=2, api_key="user",
                                           admin_api_key="admin"), tiny_model_dir, tokenizer, seed=0)
        from opd_sao.checkpoints import load_causal_lm

        engine.update_weights(load_causal_lm(tiny_model_dir).state_dict(), 2)
        result = engine.generate_all([GenerationRequest(prompt, SamplingParams(max_new_tokens=3, ignore_eos=True))])
        assert result[0].versions == [2, 2, 2]
        engine.close()
        with pytest.raises(ServerError, match="HTTP 401"):
            build_engine(EngineConfig(kind="http", urls=[remote], max_batch=2), tiny_model_dir, tokenizer, seed=0)
    finally:
        proc.kill()
        proc.wait()

