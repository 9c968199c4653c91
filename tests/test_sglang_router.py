"""Behind the real sglang-router (PyPI `sglang-router`, the Rust load balancer SGLang ships): two
`opd-sao serve` workers, generation through the router, weights and versions to the workers.

Also serve's SGLang API beyond opd-sao's own client: text prompts as SGLang's RuntimeEndpoint sends them,
batches, the fields sglang-router adds to every request, and weight syncs without the filesystem
(tensors in the request; SGLang's weight update group over gloo).
"""
from __future__ import annotations

import json
import logging
import signal
import subprocess
import threading
import time

import pytest
import requests
import torch
from launchers import start_sglang_router, wait_until_healthy

from opd_sao.engines.base import GenerationRequest, SamplingParams
from opd_sao.envs import register_env
from opd_sao.envs.arithmetic import ArithmeticEnv

pytest.importorskip("sglang_router", reason="sglang-router is a test extra: pip install -e .[test]")


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()


def _healthy_workers(start_server, checkpoint, max_batch: int) -> list:
    """[(url, process)]: two `opd-sao serve` workers (conftest's start_server: one torch thread, logs to a
    file), seeds 0 and 1, answering /health."""
    servers = [start_server(checkpoint, "--seed", i, "--max-batch", max_batch) for i in range(2)]
    for url, proc in servers:
        wait_until_healthy(url, lambda proc=proc: proc.poll() is None)
    return servers


@pytest.fixture(scope="module")
def workers(tiny_model_dir, start_server):
    servers = _healthy_workers(start_server, tiny_model_dir, 16)
    yield servers
    for _, proc in servers:
        _stop(proc)


@pytest.fixture(scope="module")
def router(workers):
    url, proc = start_sglang_router([u for u, _ in workers], "--policy", "round_robin")
    yield url
    _stop(proc)


def _perturbed(tiny_model_dir, scale: float):
    """The start weights scaled (a state dict, and the model holding it)."""
    from opd_sao.checkpoints import load_causal_lm

    model = load_causal_lm(tiny_model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    return model.state_dict(), model


@pytest.mark.parametrize("sync", ["tensor", "distributed"])
def test_weight_syncs_without_the_filesystem_reach_every_worker_behind_the_router(
        sync, router, workers, tiny_model_dir, tokenizer):
    from opd_sao.engines.fleet import Fleet
    from opd_sao.model.modeling import sequence_logprobs

    engine = Fleet(router, checkpoint=tiny_model_dir, weight_sync=sync, max_inflight=4)
    assert sorted(engine.workers) == sorted(u for u, _ in workers)  # discovered from the router's /workers
    assert not any(engine.weights_dir.iterdir())  # nothing written to disk, not even the start weights
    state, model = _perturbed(tiny_model_dir, 1.1)
    for version in (1, 2):  # the second distributed sync reuses the weight update group
        engine.update_weights(state, version)
        assert [requests.get(u + "/get_model_info").json()["weight_version"] for u, _ in workers] == [str(version)] * 2
    prompt = [tokenizer.bos_token_id] + tokenizer.encode("3+4=", add_special_tokens=False)
    results = engine.generate_all([GenerationRequest(prompt, SamplingParams(max_new_tokens=5, ignore_eos=True))
                                   for _ in range(4)])  # round robin: both workers answer
    for res in results:
        assert res.versions == [2] * 5
        ids = torch.tensor([prompt + res.token_ids])
        expected = sequence_logprobs(model, ids, torch.ones_like(ids), 1.0)[0, len(prompt):]
        assert torch.allclose(torch.tensor(res.logprobs), expected, atol=1e-5)  # the new weights, not the old
    engine.close()
    for url, _ in workers:  # restore the start weights for the other tests
        requests.post(url + "/update_weights_from_disk", json={"model_path": str(tiny_model_dir),
                                                               "weight_version": "0"}).raise_for_status()


def test_a_router_without_workers_is_refused_before_any_work(tmp_path, tiny_model_dir):
    from opd_sao.app.pipeline import run_pipeline
    from opd_sao.config import parse_config

    url, proc = start_sglang_router([])
    stage = {"name": "reasoning", "kind": "reasoning", "env": "arithmetic", "steps": 2, "sft": {"steps": 2}}
    cfg = parse_config({"model": {"path": str(tiny_model_dir)}, "logging": {"wandb": False, "progress": False},
                        "trainer": {"critic_warmup_steps": 1},
                        "engine": {"kind": "http", "urls": [url]}, "stages": [stage]})
    try:
        with pytest.raises(ValueError, match=f"engine.urls: {url} is a router with no workers registered"):
            run_pipeline(cfg, tmp_path / "run", log=lambda m: None)
    finally:
        _stop(proc)
    assert not (tmp_path / "run").exists()  # no SFT warm start paid for


def test_runtime_endpoint_text_generation_and_the_router_request_shape(router, workers, tiny_model_dir, tokenizer):
    """SGLang's RuntimeEndpoint (sglang/lang/backend/runtime_endpoint.py in the sglang 0.5.23 wheel) reads
    /get_model_info, then posts `text` with SglSamplingParams.to_srt_kwargs() (its tuple defaults arrive
    as JSON lists) and global_config's two detokenization flags. sglang needs torch 2.14.1, flashinfer and
    triton, so it is not installed here and its requests are reproduced field for field."""
    info = requests.get(router + "/get_model_info").json()
    assert info["model_path"] == str(tiny_model_dir)  # RuntimeEndpoint picks its chat template from this
    assert requests.post(router + "/flush_cache").ok
    sampling = {"skip_special_tokens": True, "spaces_between_special_tokens": True, "max_new_tokens": 6,
                "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": [], "stop_regex": [],
                "temperature": 0.7, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
                "presence_penalty": 0.0, "ignore_eos": True, "regex": None, "json_schema": None}
    body = {"text": "12+7=", "sampling_params": sampling, "return_logprob": True, "return_text_in_logprobs": True}
    out = requests.post(router + "/generate", json=body)  # through sglang-router, which adds its own keys
    assert out.status_code == 200, out.text
    obj = out.json()
    ids = tokenizer.encode("12+7=")
    assert obj["meta_info"]["prompt_tokens"] == len(ids) and len(obj["output_ids"]) == 6
    assert obj["text"] == tokenizer.decode(obj["output_ids"])
    assert [e[1] for e in obj["meta_info"]["output_token_logprobs"]] == obj["output_ids"]
    assert [e[2] for e in obj["meta_info"]["output_token_logprobs"]] == [tokenizer.decode([t]) for t in obj["output_ids"]]
    # RuntimeEndpoint.commit_lazy_operations / cache_prefix: a text prefill with no generation
    prefill = requests.post(router + "/generate", json={"text": "12+7=", "sampling_params": {"max_new_tokens": 0}})
    assert prefill.json()["output_ids"] == [] and prefill.json()["meta_info"]["prompt_tokens"] == len(ids)

    # what sglang-router adds to every request (captured from 0.3.2), sent straight to a worker: accepted
    url = workers[0][0]
    router_keys = {"model": None, "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
                   "return_hidden_states": False, "background": False, "no_logs": False, "return_bytes": False,
                   "return_entropy": False}
    plain = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}
    assert requests.post(url + "/generate", json={**plain, **router_keys}).status_code == 200
    for key, value in [("stream", True), ("return_hidden_states", True), ("return_entropy", True),
                       ("lora_path", "x"), ("image_data", "x.png"), ("model", "other")]:
        bad = requests.post(url + "/generate", json={**plain, key: value})
        assert bad.status_code == 400 and key in bad.json()["error"]["message"], (key, bad.text)
    # a top-level key serve does not know is ignored, as SGLang's FastAPI app ignores it (#42)
    assert requests.post(url + "/generate", json={**plain, "no_such_field": 1}).status_code == 200
    assert requests.post(url + "/generate", json={**plain, "text": "1"}).status_code == 400  # both prompts

    # batches: lists of text or of input_ids, one response each; a bad entry refuses the whole batch
    batch = requests.post(url + "/generate", json={"text": ["1+1=", "2+2="], "rid": ["a", "b"],
                                                   "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}).json()
    assert [r["meta_info"]["id"] for r in batch] == ["a", "b"] and all(len(r["output_ids"]) == 3 for r in batch)
    batch = requests.post(url + "/generate", json={"input_ids": [ids, ids[:2]], "sampling_params": [
        {"max_new_tokens": 1, "ignore_eos": True}, {"max_new_tokens": 2, "ignore_eos": True}]}).json()
    assert [len(r["output_ids"]) for r in batch] == [1, 2]
    refused = requests.post(url + "/generate", json={"input_ids": [ids, ids], "sampling_params": [
        {"max_new_tokens": 1}, {"min_p": 0.5}]})
    assert refused.status_code == 400 and "min_p" in refused.text

    # what sglang-router reads when it registers a worker, and its loads
    server_info = requests.get(url + "/get_server_info").json()
    assert server_info["model_path"] == str(tiny_model_dir) and requests.get(url + "/server_info").ok
    assert requests.get(url + "/get_load").json()[0]["num_reqs"] == 0
    loads = requests.get(router + "/get_loads").json()["workers"]
    assert sorted(w["worker"] for w in loads) == sorted(u for u, _ in workers) and all(w["load"] >= 0 for w in loads)


STEPS = 6  # the killed-worker stage's steps


@register_env("test-held-for-the-kill")
class HeldForTheKill(ArithmeticEnv):
    """Arithmetic whose training episodes' scoring waits for the killed-worker test's killer, so the kill lands
    mid-stage however loaded the machine is. From the trainer's step 1 until the victim is paused: at most the
    2 batches scored before (max_staleness 1) train, so the killer finds the victim at version 1 or 2. From step 3
    until the victim is killed: at most the 4 batches admitted by then train, so it dies at a version <= STEPS - 2,
    a weight sync still to come. Scoring runs on the rollout's env-step threads (slow_steps): generation goes on."""

    slow_steps = True  # the scoring waits on env-step threads, not on the fleet's
    reads_train_step = True  # training episodes only: evaluation and the validity check never wait
    paused = threading.Event()  # both set anew by the test
    killed = threading.Event()

    def __init__(self, max_operand: int = 30, train_step=None):
        super().__init__(max_operand=max_operand)
        self.train_step = train_step

    def step(self, action: str) -> tuple[str, float, bool]:
        for step, event in ((1, HeldForTheKill.paused), (3, HeldForTheKill.killed)):
            if self.train_step is not None and self.train_step() >= step:
                event.wait()
        return super().step(action)

    def corpus(self, n: int = 2000) -> list[str]:
        return []  # arithmetic's texts already train the session's tiny tokenizer: leave it as it is


def _routed(router_proc: subprocess.Popen) -> int:
    """How many /generate requests sglang-router has received (its Prometheus counter, on the metrics port
    start_sglang_router gave it)."""
    port = router_proc.args[router_proc.args.index("--prometheus-port") + 1]
    metrics = requests.get(f"http://127.0.0.1:{port}/metrics").text
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in metrics.splitlines()
               if line.startswith("smg_router_requests_total{") and 'endpoint="generate"' in line)


def _version(url: str) -> str:
    return requests.get(url + "/get_model_info").json()["weight_version"]


def test_reasoning_stage_trains_through_sglang_router_and_a_killed_worker_loses_nothing(
        tmp_path, tiny_model_dir, caplog, start_server):
    """Ordered by events, not by time (HeldForTheKill): the victim confirms a trained version; it is paused
    (/pause_generation: what the router sends it from then on waits there); once the router has received two
    more /generate requests, one of them is held on it (round robin over two workers); it is SIGKILLed."""
    from opd_sao.app.pipeline import run_pipeline
    from opd_sao.config import parse_config

    procs = _healthy_workers(start_server, tiny_model_dir, 8)
    # retries off: a request whose worker dies comes back as an error, and opd-sao's own retry must cover it
    router_url, router_proc = start_sglang_router([u for u, _ in procs], "--policy", "round_robin", "--disable-retries",
                                           "--health-check-interval-secs", "1", "--health-failure-threshold", "1")
    (survivor_url, _), (victim_url, victim) = procs
    HeldForTheKill.paused, HeldForTheKill.killed = threading.Event(), threading.Event()
    killed: dict = {}

    def kill_mid_stage() -> None:
        try:
            while not (version := _version(victim_url)).isdigit() or int(version) < 1:
                time.sleep(0.05)  # training waits at version 1 or 2 until the pause
            requests.post(victim_url + "/pause_generation", json={"mode": "abort"}).raise_for_status()
            routed = _routed(router_proc)
            HeldForTheKill.paused.set()
            while _routed(router_proc) < routed + 2:
                time.sleep(0.05)
            killed["version"] = int(_version(victim_url))
            victim.send_signal(signal.SIGKILL)
        except BaseException as err:  # reported by the test; the stage is let go either way
            killed["error"] = err
        finally:
            HeldForTheKill.paused.set()
            HeldForTheKill.killed.set()

    stage = {"name": "reasoning", "kind": "reasoning", "env": "test-held-for-the-kill",
             "env_options": {"max_operand": 9}, "steps": STEPS, "sft": {"steps": 2, "batch_size": 8},
             "eval": {"num_tasks": 4}, "rollout": {"max_new_tokens": 8, "max_staleness": 1}}
    cfg = parse_config({"seed": 1, "model": {"path": str(tiny_model_dir)},
                        "logging": {"wandb": False, "progress": False},
                        "engine": {"kind": "http", "urls": [router_url], "max_batch": 8},
                        "trainer": {"train_batch_size": 4, "critic_warmup_steps": 0}, "stages": [stage]})
    killer = threading.Thread(target=kill_mid_stage, daemon=True)
    killer.start()
    try:
        with caplog.at_level(logging.INFO):  # the fleet's and the retry policy's (opd_sao.engines.retry) records
            summary = run_pipeline(cfg, tmp_path, log=lambda m: None)
        killer.join()  # done: the stage cannot finish before the kill (or the killer's error)
        # the router's health check marks the dead worker (no deadline of ours: pytest's timeout is the backstop)
        while [w["url"] for w in requests.get(router_url + "/workers").json()["workers"]
               if w["is_healthy"]] != [survivor_url]:
            time.sleep(0.2)
        final_version = _version(survivor_url)
    finally:
        HeldForTheKill.paused.set()
        HeldForTheKill.killed.set()  # a failed run never leaves scoring threads waiting
        _stop(router_proc)
        for _, proc in procs:
            _stop(proc)
    assert "error" not in killed, killed
    assert 1 <= killed["version"] <= STEPS - 2  # killed after a trained version, with a weight sync to come
    result = summary["stages"][0]
    assert result["gate"]["passed"] is True and result["gate"]["evaluations"] >= 2
    stage_dir = tmp_path / "stages" / "reasoning"
    trained = [t for line in (stage_dir / "trained.jsonl").read_text().splitlines() for t in json.loads(line)["traj_ids"]]
    assert len(trained) == len(set(trained)) == STEPS * 4  # every step a full batch of distinct trajectories
    assert final_version == str(STEPS)  # the survivor got every weight sync
    messages = [r.getMessage() for r in caplog.records]
    assert any(f"taking {victim_url} out of the fleet" in m for m in messages), messages
    # the requests held on the victim came back from the router as HTTP 500 (a pause's abort is a 200), and
    # opd-sao sent them again: its retry policy (retry.ROUTER_TRANSIENT_STATUS), or the fleet's resend after it
    router_host = router_url.split("://", 1)[1]
    assert any("sent again" in m and "HTTP 500" in m and router_host in m for m in messages), messages
