"""Rollout servers: 3 `opd-sao serve` subprocesses on loopback, driven over SGLang's native API.

The API client against our server (logprobs equal the trainer's, prompt scoring), load-aware routing,
and an SAO stage that trains through the router while one server is SIGKILLed: no trajectory is lost.
"""
from __future__ import annotations

import gc
import itertools
import json
import signal
import time

import pytest
import requests
import torch
from launchers import wait_until_healthy

from opd_sao.engines.base import GenerationRequest, SamplingParams

N_SERVERS = 3


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, start_server):
    """[(url, process)]: real servers, one torch thread each, started in parallel."""
    servers = [start_server(tiny_model_dir, "--seed", i, "--max-batch", 16) for i in range(N_SERVERS)]
    for url, proc in servers:
        wait_until_healthy(url, lambda proc=proc: proc.poll() is None)
    yield servers
    for _, proc in servers:
        proc.kill()
        proc.wait()


def test_api_logprobs_match_the_trainer_and_prompts_are_scored(fleet, tiny_model_dir, tokenizer):
    from opd_sao.checkpoints import load_causal_lm
    from opd_sao.engines.fleet import Fleet
    from opd_sao.engines.http import SGLangClient
    from opd_sao.model.modeling import sequence_logprobs

    url = fleet[0][0]
    engine = Fleet(url, checkpoint=tiny_model_dir, max_inflight=4)
    prompts = [[tokenizer.bos_token_id] + tokenizer.encode(f"{a}+{a}=", add_special_tokens=False) for a in range(6)]
    results = engine.generate_all([GenerationRequest(p, SamplingParams(0.8, 1.0, 6, ignore_eos=True)) for p in prompts])
    model = load_causal_lm(tiny_model_dir)
    for prompt, res in zip(prompts, results):
        assert len(res.token_ids) == 6 and res.finish_reason == "length" and res.versions == [0] * 6
        ids = torch.tensor([prompt + res.token_ids])
        trainer = sequence_logprobs(model, ids, torch.ones_like(ids), 0.8)[0, len(prompt):]
        assert torch.allclose(torch.tensor(res.logprobs), trainer, atol=1e-5)

    # teacher scoring: prompt logprobs and top-k, no generation
    ids = prompts[0] + results[0].token_ids
    scores = engine.score(ids, start=2, top_k=3)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    expected = [float(logp[t - 1, ids[t]]) for t in range(2, len(ids))]
    assert torch.allclose(torch.tensor(scores.token_logprobs), torch.tensor(expected), atol=1e-5)
    assert scores.top_ids[0] == logp[1].topk(3).indices.tolist()
    assert len(scores.top_logprobs) == len(ids) - 2

    # the API's own answers: unsupported options are refused by name, not ignored
    bad = requests.post(url + "/generate", json={"input_ids": prompts[0], "sampling_params": {"min_p": 0.05}})
    assert bad.status_code == 400 and "min_p" in bad.json()["error"]["message"]
    SGLangClient(url).flush_cache()
    weights = engine.weights_dir
    engine.close()
    assert not weights.exists()  # its own temporary weights directory goes with it


def test_an_unclosed_engine_leaves_no_weights_directory(fleet, tiny_model_dir):
    from opd_sao.engines.fleet import Fleet

    engine = Fleet(fleet[0][0], checkpoint=tiny_model_dir)
    weights = engine.weights_dir
    assert weights.is_dir()
    del engine
    gc.collect()
    assert not weights.exists()


def test_a_dead_url_is_reported_at_start(fleet, free_port):
    from opd_sao.engines.fleet import Fleet

    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ValueError, match=f"rollout server {dead} is not answering /health"):
        Fleet([fleet[0][0], dead])


def test_a_worker_that_dies_after_loading_a_sync_before_confirming_it_leaves_the_fleet(
        tiny_model_dir, start_server, monkeypatch, caplog):
    """The race the router test met in CI: a worker loads a sync's weights and is killed before /model_info
    confirms the new version. It is taken out of the fleet (it gets the weights when it comes back), the
    survivor confirms, and the sync succeeds instead of raising ServerDown. Ordered by the sync itself: the
    real tensor push runs, then the victim is killed, then the fleet asks for the versions."""
    import logging

    from opd_sao.checkpoints import load_causal_lm
    from opd_sao.engines.fleet import Fleet
    from opd_sao.engines.weight_sync import WEIGHT_SYNCS

    servers = [start_server(tiny_model_dir, "--seed", i) for i in range(2)]
    for url, proc in servers:
        wait_until_healthy(url, lambda proc=proc: proc.poll() is None)
    (survivor, _), (victim_url, victim) = servers
    tensor_sync = WEIGHT_SYNCS.get("tensor")
    push = tensor_sync.push

    def push_then_lose_the_victim(self, state_dict, version, clients, each):
        done = push(self, state_dict, version, clients, each)
        victim.kill()
        victim.wait()
        return done

    engine = Fleet([survivor, victim_url], checkpoint=tiny_model_dir, weight_sync="tensor", probe_s=60.0)
    monkeypatch.setattr(tensor_sync, "push", push_then_lose_the_victim)
    state = {k: v * 1.01 for k, v in load_causal_lm(tiny_model_dir).state_dict().items()}
    with caplog.at_level(logging.WARNING):
        engine.update_weights(state, 1)
    assert engine.version == 1
    assert {url: s["alive"] for url, s in engine.stats.items()} == {survivor: True, victim_url: False}
    assert requests.get(survivor + "/model_info").json()["weight_version"] == "1"
    assert any(f"taking {victim_url} out of the fleet" in r.getMessage() for r in caplog.records)
    engine.close()


def test_router_sends_requests_to_the_server_with_fewest_tokens_in_flight(fleet, tiny_model_dir, tokenizer):
    from opd_sao.engines.fleet import Fleet

    a, b = fleet[0][0], fleet[1][0]
    router = Fleet([a, b], checkpoint=tiny_model_dir, max_inflight=8)
    prompt = [tokenizer.bos_token_id, 5, 6]
    long = GenerationRequest(prompt, SamplingParams(max_new_tokens=64, ignore_eos=True), est_tokens=64)
    shorts = [GenerationRequest(prompt, SamplingParams(max_new_tokens=4, ignore_eos=True), est_tokens=4)
              for _ in range(6)]
    router.generate_all([long] + shorts)
    stats = router.stats
    # round-robin would put 3 short requests behind the long one; by load all 6 go to the other server
    assert (stats[a]["requests"], stats[b]["requests"]) == (1, 6)
    assert stats[a]["tokens"] == 64 and stats[b]["tokens"] == 24
    router.close()


def test_stage_trains_through_the_router_and_a_killed_server_loses_no_trajectory(
        fleet, tmp_path, tiny_model_dir, tokenizer):
    """Ordered by the trainer's steps, not by time, so load cannot reorder it (after_step runs on the trainer's
    thread: the next step waits for it). After step 0, once every episode admitted so far has finished (none
    can start before step 1), the victim is paused (/pause_generation: nothing runs on it to abort, and what it
    is sent from then on waits there). After step 1 the next episodes start on an idle fleet, the first on the
    victim (first in engine.urls: least_loaded's ties go to it); once it holds one it is SIGKILLed, with steps
    2 and 3 and their weight syncs still to come."""
    from opd_sao.config import AlgoConfig, EngineConfig, RolloutConfig, TrainerConfig
    from opd_sao.engines import build_engine
    from opd_sao.envs import ENVIRONMENTS
    from opd_sao.io.tracking import MetricsLogger
    from opd_sao.rl.learner import Learner
    from opd_sao.rl.loop import RLLoop
    from opd_sao.rl.rollout import Episode
    from opd_sao.trainers import TorchTrainer

    (victim_url, victim), survivors = fleet[-1], [url for url, _ in fleet[:-1]]
    engine = build_engine(EngineConfig(kind="http", urls=[victim_url] + survivors, max_batch=4), tiny_model_dir,
                          tokenizer, seed=0)
    env_cls = ENVIRONMENTS.get("arithmetic")
    tasks = itertools.cycle(env_cls().make_tasks("train", 50, seed=0))
    started: set[str] = set()

    class CountedEpisode(Episode):
        def request(self):
            started.add(self.traj.traj_id)
            return super().request()

    def make_episodes():
        return [CountedEpisode(env_cls(), next(tasks), tokenizer, SamplingParams(max_new_tokens=12, ignore_eos=True),
                               domain="arithmetic", max_turns=1, max_context_tokens=64)]

    batch, max_staleness = 4, 2
    killed: dict = {}

    def kill_mid_stage(step: int) -> None:
        if step == 0:  # the episodes admitted before step 1 (max_staleness + 2 batches) all finished
            while len(arrived) < (max_staleness + 2) * batch:
                time.sleep(0.01)
            requests.post(victim_url + "/pause_generation", json={"mode": "abort"}).raise_for_status()
            killed["at_pause"] = engine.stats[victim_url]
        elif step == 1:  # no deadline of ours: pytest's timeout is the backstop
            while not (held := engine.stats[victim_url]["inflight"]):
                time.sleep(0.01)
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            killed["held"] = held

    backend = TorchTrainer(tiny_model_dir, TrainerConfig(train_batch_size=batch, critic_warmup_steps=0))
    learner = Learner(backend, "sao", AlgoConfig(), critic_steps=1, critic_warmup_steps=0)
    loop = RLLoop(engine=engine, learner=learner, make_episodes=make_episodes,
                  rollout=RolloutConfig(group_size=1, max_staleness=max_staleness), train_batch_size=batch,
                  pad_id=tokenizer.pad_token_id, logger=MetricsLogger(tmp_path / "metrics.jsonl", stage="t"),
                  trained_log=tmp_path / "trained.jsonl", after_step=kill_mid_stage)
    arrived = []
    put = loop.buffer.put
    loop.buffer.put = lambda traj: (arrived.append(traj), put(traj))
    history = loop.run(steps=4)

    stats = engine.stats
    lines = (tmp_path / "trained.jsonl").read_text().splitlines()
    trained = [t for line in lines for t in json.loads(line)["traj_ids"]]
    assert len(history) == 4 and len(trained) == len(set(trained)) == 4 * batch
    assert killed["at_pause"]["inflight"] == 0 and killed["held"] >= 1  # the pause cut nothing; the kill did
    assert not stats[victim_url]["alive"]
    # what the kill cut off was sent again (the pause aborted nothing: every send again since is the kill's)
    assert stats[victim_url]["requeued"] - killed["at_pause"]["requeued"] >= killed["held"]
    assert sorted(t.traj_id for t in arrived) == sorted(started)  # every started episode finished: none lost
    assert all(stats[u]["alive"] and stats[u]["requests"] > 0 for u in survivors)
    # weights reached every live server, confirmed by the version each reports and stamps on its tokens
    assert engine.version == backend.policy_version == 4
    assert all(requests.get(u + "/get_model_info").json()["weight_version"] == "4" for u in survivors)
    assert max(max(t.versions) for t in arrived) >= 1
    engine.close()


@pytest.mark.parametrize("status,answer,said", [
    (400, {"error": {"message": "the sampler refused a NaN probability"}}, "the sampler refused a NaN probability"),
    (200, {"meta_info": {"output_token_logprobs": [[-0.1, 5, None]]}}, "does not return output_token_sampling_logprobs"),
])
def test_the_top_p_probe_says_what_the_server_answered(status, answer, said):
    """Before rollouts at top_p < 1 the client probes each server: a server that fails the probe is reported with
    its own error (a server bug is not a missing feature); one that answers without the renormalised logprobs is
    reported as lacking them."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from opd_sao.engines.http import SGLangClient

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ValueError, match=said):
            SGLangClient(f"http://127.0.0.1:{server.server_port}", retries=0).check_sampling_mask()
    finally:
        server.shutdown()
