"""Training through `engine.kind: http` against workers that behave as SGLang 0.5.23 does: `opd-sao serve`
with SGLang's own server-side code plugged in (tests/sglang_worker.py: its tensor deserialiser, its
process-group helper and broadcast receive, its request models), in every weight-sync mode and at top_p 0.9.
Also the client's calls checked against SGLang's code directly: the tensor payload SGLang reads, the
process group SGLang forms, the positions SGLang gives prompt logprobs, the support SGLang's sampler draws from
at top_k/top_p, its scheduler's sampling-mask rule, and sglang-router dropping return_sampling_mask (so the
fleet sends top-p requests to the router's workers directly).
"""
from __future__ import annotations

import datetime
import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest
import sglang_code
import torch
from launchers import free_port, wait_until_healthy

pytestmark = pytest.mark.skipif(not sglang_code.installed(),
                                reason="sglang 0.5.23 (pip install --no-deps sglang==0.5.23; scripts/setup.sh)")
WORKER = Path(__file__).resolve().parent / "sglang_worker.py"


@pytest.fixture(scope="module")
def sglang_workers(tiny_model_dir, tmp_path_factory):
    """[url, url]: two SGLang-semantics workers (seeds 0 and 1), one torch thread each."""
    logs, procs = tmp_path_factory.mktemp("sglang-worker-logs"), []
    for seed in range(2):
        port = free_port()
        with open(logs / f"worker-{port}.log", "w") as log:
            procs.append((f"http://127.0.0.1:{port}", subprocess.Popen(
                [sys.executable, str(WORKER), str(tiny_model_dir), "--port", str(port), "--threads", "1", "--seed",
                 str(seed), "--max-batch", "8", "--group-timeout-s", "30"], stdout=log, stderr=subprocess.STDOUT)))
    for url, proc in procs:
        wait_until_healthy(url, lambda proc=proc: proc.poll() is None)
    yield [url for url, _ in procs]
    for _, proc in procs:
        proc.kill()
        proc.wait()


def _scores(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return torch.tensor([float(logp[t - 1, ids[t]]) for t in range(1, len(ids))])


@pytest.fixture
def sglang_router(sglang_workers):
    """The real sglang-router (0.3.2) in front of the two workers, round robin."""
    pytest.importorskip("sglang_router", reason="sglang-router is a test extra: pip install -e .[test]")
    from launchers import start_sglang_router

    url, proc = start_sglang_router(sglang_workers, "--policy", "round_robin")
    yield url
    proc.kill()
    proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("sync,top_p,routed", [("disk", 1.0, False), ("tensor", 1.0, False),
                                               ("distributed", 1.0, False), ("tensor", 0.9, False),
                                               ("tensor", 0.9, True)],
                         ids=["disk", "tensor", "distributed", "tensor-top_p-0.9", "top_p-0.9-sglang-router"])
def test_a_reasoning_stage_trains_through_sglang_semantics_workers(sync, top_p, routed, sglang_workers, tmp_path,
                                                                   tiny_model_dir, tokenizer, request):
    """The workers end with the stage's checkpoint (their prompt scores equal it and differ from the start's),
    confirm its version, and the consistency gate passes at its default thresholds; tensor and distributed
    syncs travel in several buckets (a 64 KiB bound). `routed`: engine.urls is sglang-router 0.3.2 in front of
    the workers, which drops return_sampling_mask, so the top-p rollouts and the gate's probes reach them only
    because the fleet sends those to the workers directly (through the router they would come back without
    output_token_sampling_logprobs, and the client would fail them)."""
    from opd_sao.app.pipeline import run_pipeline
    from opd_sao.checkpoints import load_causal_lm
    from opd_sao.config import parse_config
    from opd_sao.engines.http import SGLangClient

    urls = [request.getfixturevalue("sglang_router")] if routed else sglang_workers
    steps = 3
    stage = {"name": "reasoning", "kind": "reasoning", "env": "arithmetic", "env_options": {"max_operand": 9},
             "steps": steps, "sft": {"steps": 2, "batch_size": 8}, "eval": {"num_tasks": 4},
             "rollout": {"max_new_tokens": 8, "top_p": top_p}}
    cfg = parse_config({"seed": 1, "model": {"path": str(tiny_model_dir)},
                        "logging": {"wandb": False, "progress": False},
                        "engine": {"kind": "http", "urls": urls, "max_batch": 8, "weight_sync": sync,
                                   "weight_sync_bucket_mb": 1 / 16},
                        "trainer": {"train_batch_size": 4, "critic_warmup_steps": 0}, "stages": [stage]})
    summary = run_pipeline(cfg, tmp_path, log=lambda m: None)
    gate = summary["stages"][0]["gate"]
    assert gate["passed"] is True and gate["evaluations"] >= 2, gate
    clients = [SGLangClient(url) for url in sglang_workers]
    assert [c.weight_version() for c in clients] == [str(steps)] * 2
    trained = load_causal_lm(tmp_path / "stages" / "reasoning" / "checkpoint")
    ids = [tokenizer.bos_token_id] + tokenizer.encode("7+8=15 and 3+4=7", add_special_tokens=False)
    expected, before = _scores(trained, ids), _scores(load_causal_lm(tiny_model_dir), ids)
    assert not torch.allclose(expected, before, atol=1e-3)  # training moved the weights
    for client in clients:
        got = torch.tensor(client.score(ids, 1).token_logprobs)
        assert torch.allclose(got, expected, atol=1e-5), (client.url, (got - expected).abs().max())
    if top_p < 1:  # what each worker sampled from (top_k 4096 within its scheduler's rule) is what the trainer scores
        _sampled_as_the_trainer_scores(clients, trained, ids[:6], cfg.stages[0].gate.mean_abs_diff)


def _sampled_as_the_trainer_scores(clients, model, prompt: list[int], threshold: float) -> None:
    """Each worker's sampled-token logprobs at top_p 0.9 (return_sampling_mask, through its scheduler's check)
    equal the trainer's `sequence_logprobs` of the same tokens at top_p 0.9, within the gate's mean threshold."""
    from opd_sao.engines.base import GenerationRequest, SamplingParams
    from opd_sao.model.modeling import sequence_logprobs

    for client in clients:
        out = client.generate(GenerationRequest(prompt, SamplingParams(1.0, 0.9, 12, ignore_eos=True)))
        full = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            trainer = sequence_logprobs(model, full, torch.ones_like(full), top_p=torch.tensor([0.9]))[0, len(prompt):]
        diff = (trainer - torch.tensor(out.logprobs)).abs()
        assert len(out.token_ids) == 12 and float(diff.max()) < threshold, (client.url, diff)


def test_the_trainer_and_the_embedded_engine_score_sglangs_top_k_top_p_support():
    """Over a vocabulary past SGLang's sampling-mask cap (6000 ids), `nucleus_logprobs` (trainer, gate, embedded
    engine) is the distribution SGLang's own sampler (`top_k_top_p_min_p_sampling_from_probs_torch`, loaded from
    the wheel) draws from at the top_k the client sends: top_p rows cut at 4096 (where the nucleus alone is wider),
    a row's own smaller top_k kept; the embedded engine's draws lie in that support with those logprobs."""
    from opd_sao.model.modeling import SAMPLING_MASK_TOP_K, nucleus_logprobs, nucleus_top_k, sample_tokens

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 6000, generator=g) * torch.tensor([[0.1], [0.5], [3.0], [2.0]])
    top_p, own_k, temperature = torch.tensor([0.9, 0.95, 0.9, 0.9]), torch.tensor([-1, -1, -1, 50]), torch.ones(4)
    k = nucleus_top_k(top_p, own_k)
    assert k.tolist() == [SAMPLING_MASK_TOP_K] * 3 + [50]
    sglang = sglang_code.sampled_support(torch.softmax(logits, -1), k, top_p)
    ours = nucleus_logprobs(logits, temperature, top_p, own_k)
    assert torch.equal(ours.exp() > 0, sglang > 0) and torch.allclose(ours.exp(), sglang, atol=1e-7)
    assert (sglang > 0).sum(-1).tolist()[:2] == [4096, 4096]  # the cap cut both ...
    uncapped = sglang_code.sampled_support(torch.softmax(logits, -1), torch.full((4,), 1 << 30), top_p)
    assert bool(((uncapped > 0).sum(-1)[:2] > 4096).all())  # ... whose nucleus alone is wider
    ids, logp, _ = sample_tokens(logits, temperature, top_p, g, own_k)
    chosen = sglang.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    assert bool((chosen > 0).all()) and torch.allclose(logp, chosen.log(), atol=1e-5)


def test_the_workers_take_sampling_mask_requests_as_sglangs_scheduler_does(sglang_workers):
    """The workers apply SGLang's scheduler check (its code, from the wheel): a return_sampling_mask request
    without top_k (SGLang's 2^30) or above 4096 is refused with HTTP 400 and the scheduler's message; the
    client's, top_k 4096, is taken and answers the renormalised logprobs."""
    import requests

    from opd_sao.engines.http import SGLangClient

    def ask(**sampling) -> requests.Response:
        return requests.post(sglang_workers[0] + "/generate", timeout=60, json={
            "input_ids": [0, 5], "sampling_params": {"max_new_tokens": 2, "top_p": 0.9, **sampling},
            "return_logprob": True, "return_sampling_mask": True})

    for sampling, got in (({}, "top_k=1073741824"), ({"top_k": 4097}, "top_k=4097")):
        answer = ask(**sampling)
        assert answer.status_code == 400 and "return_sampling_mask requires top_k=1" in answer.text \
            and got in answer.text, answer.text
    assert ask(top_k=1).status_code == 200
    taken = ask(top_k=4096)
    meta = taken.json()["meta_info"] if taken.status_code == 200 else taken.text
    sampled, vocab = meta["output_token_sampling_logprobs"], [p[0] for p in meta["output_token_logprobs"]]
    assert len(sampled) == 2 and all(s >= v for s, v in zip(sampled, vocab))  # renormalised on the support
    SGLangClient(sglang_workers[0]).check_sampling_mask()  # the client's probe: top_k 4096


def test_behind_sglang_router_top_p_requests_go_to_the_workers_directly(sglang_workers, sglang_router, tiny_model_dir):
    """sglang-router 0.3.2 drops return_sampling_mask when it forwards /generate (a request the workers refuse
    directly, 400, passes through it: they never saw the mask asked), so the fleet on the router sends each top_p
    < 1 request to a worker itself (its routing policy picks one) with the field, and the others through the router."""
    import requests

    from opd_sao.engines.base import GenerationRequest, SamplingParams
    from opd_sao.engines.fleet import Fleet

    body = {"input_ids": [0, 5], "sampling_params": {"max_new_tokens": 1, "top_p": 0.9},
            "return_logprob": True, "return_sampling_mask": True}
    assert requests.post(sglang_workers[0] + "/generate", json=body, timeout=60).status_code == 400
    through = requests.post(sglang_router + "/generate", json=body, timeout=60)
    assert through.status_code == 200 and "output_token_sampling_logprobs" not in through.json()["meta_info"]

    fleet = Fleet(sglang_router, checkpoint=tiny_model_dir, weight_sync="tensor", max_inflight=2)  # at version 0
    nucleus = fleet.generate_all([GenerationRequest([0, 5], SamplingParams(1.0, 0.9, 3, ignore_eos=True))
                                  for _ in range(4)])
    before = fleet.stats
    assert before[sglang_router]["requests"] == 0 and sum(before[u]["requests"] for u in sglang_workers) == 4
    for result in nucleus:  # the renormalised support logprobs (at least the whole-vocabulary ones)
        assert len(result.logprobs) == 3 and all(s >= v - 1e-6 for s, v in zip(result.logprobs, result.vocab_logprobs))
    fleet.generate_all([GenerationRequest([0, 5], SamplingParams(1.0, 1.0, 3, ignore_eos=True)) for _ in range(3)])
    after = fleet.stats
    assert after[sglang_router]["requests"] == 3  # through the router, the workers' counts unchanged
    assert all(after[u]["requests"] == before[u]["requests"] for u in sglang_workers)
    fleet.close()


@pytest.mark.slow
def test_a_top_p_stage_behind_sglang_router_with_an_unreachable_worker_is_refused_in_one_line(
        sglang_router, tmp_path, tiny_model_dir):
    """Behind a router the top-p requests and weight syncs go to its workers directly: one that does not answer
    (here engine.workers lists a closed port) refuses the stage in one line before anything is written."""
    from launchers import free_port

    from opd_sao.app.pipeline import run_pipeline
    from opd_sao.config import parse_config
    from opd_sao.errors import UsageError

    dead = f"http://127.0.0.1:{free_port()}"
    stage = {"name": "reasoning", "kind": "reasoning", "env": "arithmetic", "steps": 1,
             "rollout": {"max_new_tokens": 8, "top_p": 0.9}}
    cfg = parse_config({"model": {"path": str(tiny_model_dir)}, "logging": {"wandb": False, "progress": False},
                        "engine": {"kind": "http", "urls": [sglang_router], "workers": [dead]},
                        "trainer": {"critic_warmup_steps": 0}, "stages": [stage]})
    with pytest.raises(UsageError, match=f"rollout worker {dead} is not answering /health") as refused:
        run_pipeline(cfg, tmp_path / "run", log=lambda m: None)
    assert "\n" not in str(refused.value) and not (tmp_path / "run" / "stages").exists()


def test_the_workers_refuse_flush_cache_while_a_request_runs_and_hold_requests_while_paused(sglang_workers):
    """SGLang's scheduler (its flush_cache code, in the worker) refuses /flush_cache while a request runs (400,
    "Flush cache failed."), and takes it once none runs; while paused a new request waits (it is not running, so
    a flush passes) and runs whole after /continue_generation: the sequence a weight sync's pause goes through."""
    import threading

    import requests

    url, answers = sglang_workers[0], {}
    long = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}

    def send(name, body):
        answers[name] = requests.post(url + "/generate", json=body, timeout=600)

    def running() -> int:
        return requests.get(url + "/v1/loads", timeout=60).json()["loads"][0]["num_running_reqs"]

    first = threading.Thread(target=send, args=("long", long))
    first.start()
    while not running():
        assert first.is_alive(), answers["long"].text
    refused = requests.post(url + "/flush_cache", timeout=60)
    assert (refused.status_code, refused.text) == (400, "Flush cache failed.\n")
    assert requests.post(url + "/pause_generation", json={"mode": "abort"}, timeout=60).status_code == 200
    first.join(60)
    assert answers["long"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    held = threading.Thread(target=send, args=("held", {**long, "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}))
    held.start()
    assert requests.post(url + "/flush_cache", timeout=60).status_code == 200  # the held request is not running
    assert held.is_alive() and running() == 0
    assert requests.post(url + "/continue_generation", json={}, timeout=60).status_code == 200
    held.join(60)
    assert answers["held"].json()["meta_info"]["finish_reason"]["type"] == "length"


def test_tensor_payloads_are_read_by_sglangs_deserialiser_and_request_model():
    """Both load formats: SGLang's MultiprocessingSerializer (SafeUnpickler) reads each bucket back exactly,
    as its model runner rebuilds it (FlattenedTensorBucket), and its request model takes the body."""
    from opd_sao.engines.weight_sync.base import buckets
    from opd_sao.engines.weight_sync.tensor import serialize

    tensors = {"a": torch.randn(3, 4), "b": torch.randn(5).to(torch.bfloat16), "c": torch.randn(7, 2)}
    parts = buckets(tensors, 60)
    assert [[n for n, _ in b] for b in parts] == [["a"], ["b"], ["c"]]  # one dtype per bucket, 60 bytes at most
    deserialize = sglang_code.common()["MultiprocessingSerializer"].deserialize
    bucket = sglang_code.tensor_bucket()
    bucket_cls, meta_cls = bucket["FlattenedTensorBucket"], bucket["FlattenedTensorMetadata"]
    for load_format in (None, "flattened_bucket"):
        for part in parts:
            data = serialize(part, load_format)
            body = {"serialized_named_tensors": [data, data], "load_format": load_format, "weight_version": "3"}
            request = sglang_code.validate_request("UpdateWeightsFromTensorReqInput", body)
            obj = deserialize(request.serialized_named_tensors[1])  # tensor-parallel rank 1 reads its own entry
            if load_format is None:
                got = obj
            else:
                metadata = [meta_cls(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                     end_idx=m.end_idx, numel=m.numel) for m in obj["metadata"]]
                got = bucket_cls(flattened_tensor=obj["flattened_tensor"], metadata=metadata).reconstruct_tensors()
            assert [n for n, _ in got] == [n for n, _ in part]
            assert all(t.dtype == tensors[n].dtype and torch.equal(t, tensors[n]) for n, t in got)


def test_the_trainers_group_is_the_one_sglang_forms_with_several_ranks(tmp_path):
    """The trainer (rank 0, opd-sao's new_group on the store it hosts) and three SGLang ranks (two workers, one
    of them tensor-parallel 2: rank_offset + tp_rank) form one group; a flattened bucket reaches every rank."""
    import torch.distributed as dist

    from opd_sao.engines.weight_sync.distributed import _bucket, new_group

    tensors = [("w", torch.randn(4, 3)), ("v", torch.randn(6))]
    meta, flat = _bucket(tensors)
    store = dist.TCPStore("127.0.0.1", 0, 4, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    ctx = multiprocessing.get_context("spawn")
    ranks = [ctx.Process(target=sglang_code.join_and_receive, args=(store.port, 4, rank, meta["names"], meta["dtypes"],
                                                     meta["shapes"], tmp_path)) for rank in (1, 2, 3)]
    for proc in ranks:
        proc.start()
    group = new_group(store, 0, 4, "opd-sao-test", "gloo", datetime.timedelta(seconds=120))
    dist.broadcast(flat, src=0, group=group)
    for proc in ranks:
        proc.join(120)
    dist.destroy_process_group(group)
    assert [proc.exitcode for proc in ranks] == [0, 0, 0]
    for rank in (1, 2, 3):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert all(torch.equal(got[n], t) for n, t in tensors)


def test_score_reads_sglangs_prompt_logprob_positions(tiny_model_dir, tokenizer):
    """SGLang's scheduler shifts its logits processor's values (entry i: the logprob of token start+i+1) by
    one and puts None first, so entry j pairs input_ids[start+j] with its logprob and the first is None
    wherever it starts. The client asks from start-1: its answer is each token's logprob given the prefix."""
    from opd_sao.checkpoints import load_causal_lm

    model = load_causal_lm(tiny_model_dir)
    ids = [tokenizer.bos_token_id] + tokenizer.encode("12+30=42", add_special_tokens=False)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    for start in (1, 3):
        asked = start - 1  # what the client sends as logprob_start_len
        raw = [float(logp[p, ids[p + 1]]) for p in range(asked, len(ids) - 1)] + [-0.5]  # last: a sampled token's
        values, token_ids = sglang_code.process_input_token_logprobs(raw, ids, asked, logp.shape[-1])
        assert values[0] is None and token_ids == ids[asked:]
        answer = [[v, t, None] for v, t in zip(values, token_ids)]
        scored = [entry[0] for entry in answer[1:]]  # the client drops SGLang's first entry
        assert scored == pytest.approx([float(logp[t - 1, ids[t]]) for t in range(start, len(ids))], abs=1e-6)


@pytest.mark.parametrize("api_key,admin_api_key", [("k", None), (None, "admin"), ("k", "admin")])
def test_the_client_passes_sglangs_auth_on_every_endpoint_it_calls(api_key, admin_api_key):
    """A loopback server that decides every request as SGLang's API-key middleware does (its
    `decide_request_auth`, each path's auth level read from its http_server.py) with the server's keys
    `api_key` / `admin_api_key`; the client, given the same keys, passes on every call it makes, and without
    them it is refused (401)."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from opd_sao.engines.http import ServerError, SGLangClient

    sglang_auth = sglang_code.auth()
    levels, level_cls = sglang_auth["levels"], sglang_auth["AuthLevel"]

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _answer(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            decision = sglang_auth["decide_request_auth"](
                method=self.command, path=self.path, authorization_header=self.headers.get("Authorization"),
                api_key=api_key, admin_api_key=admin_api_key, auth_level=level_cls[levels.get(self.path, "NORMAL")])
            status = 200 if decision.allowed else decision.error_status_code
            body = json.dumps({"success": True, "weight_version": "1", "tp_size": 1}).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    weight_paths = ["/update_weights_from_disk", "/update_weights_from_tensor", "/init_weights_update_group",
                    "/update_weights_from_distributed", "/destroy_weights_update_group"]
    assert all(levels[p] == "ADMIN_OPTIONAL" for p in weight_paths + ["/begin_weight_update"])
    try:
        def calls(client):
            return [client.model_info, client.server_info, client.flush_cache, client.begin_weight_update,
                    client.end_weight_update] + [lambda p=p: client.weight_call(p, {}) for p in weight_paths]

        keyed = SGLangClient(url, api_key=api_key, admin_api_key=admin_api_key, retries=0)
        for call in calls(keyed):
            call()
        refused = 0
        for call in calls(SGLangClient(url, retries=0)):
            try:
                call()
            except ServerError as err:
                assert err.status == 401
                refused += 1
        assert refused == (10 if api_key else 8)  # an admin key alone guards only the admin endpoints
    finally:
        server.shutdown()


def test_serves_side_of_each_mode_refuses_bad_weights_before_loading_any(tiny_model_dir, start_server):
    """Serve's handlers (the modes' server sides): float64 / integer tensors, NaN or inf values, an unknown
    name, a wrong shape, a load outside a session, a distributed update naming a float64 dtype, and a pickle
    that would run code are each a 400 in one line, and the served weights stay as they were."""
    import base64
    import math
    import pickle

    import requests

    from opd_sao.checkpoints import load_causal_lm
    from opd_sao.engines.http import SGLangClient
    from opd_sao.engines.weight_sync.tensor import serialize

    url, proc = start_server(tiny_model_dir)
    wait_until_healthy(url, lambda: proc.poll() is None)
    client = SGLangClient(url)
    state = load_causal_lm(tiny_model_dir).state_dict()
    name = next(k for k in state if k.endswith("q_proj.weight"))
    weight = state[name]
    ids = [1, 5, 6, 7, 8]
    before = client.score(ids, 1).token_logprobs

    def tensor_update(named, load_format="flattened_bucket"):
        return requests.post(url + "/update_weights_from_tensor", timeout=60, json={
            "serialized_named_tensors": [serialize(named, load_format)], "load_format": load_format,
            "weight_version": "9"})

    outside = tensor_update([(name, weight)])
    assert outside.status_code == 400 and "weight-update session" in outside.json()["message"]

    class Gadget:  # a pickle that would call os.system when loaded
        def __reduce__(self):
            import os
            return os.system, ("echo pwned",)

    assert client.begin_weight_update()
    for named, load_format, said in [
            ([(name, weight.double())], "flattened_bucket", "float64"),
            ([(name, weight.to(torch.int32))], None, "int32"),
            ([(name, torch.full_like(weight, math.nan))], "flattened_bucket", "non-finite"),
            ([(name, weight.clone().index_fill_(0, torch.tensor([0]), math.inf))], None, "non-finite"),
            ([("model.not_a_layer.weight", weight)], None, "not a parameter"),
            ([(name, weight[:2])], None, "shape")]:
        answer = tensor_update(named, load_format)
        assert answer.status_code == 400 and said in answer.json()["message"], answer.text
    evil = base64.b64encode(pickle.dumps([(name, Gadget())])).decode()
    answer = requests.post(url + "/update_weights_from_tensor", timeout=60,
                           json={"serialized_named_tensors": [evil], "load_format": None})
    assert answer.status_code == 400 and "system is not allowed" in answer.json()["message"], answer.text
    answer = requests.post(url + "/update_weights_from_distributed", timeout=60, json={
        "names": [name], "dtypes": ["float64"], "shapes": [list(weight.shape)], "group_name": "none"})
    assert answer.status_code == 400, answer.text  # no group joined: refused before any receive
    client.end_weight_update()
    assert client.weight_version() != "9" and client.score(ids, 1).token_logprobs == before


def test_the_workers_run_sglangs_request_models(sglang_workers):
    """The plug-ins are live: a weight call with a field serve ignores but SGLang's request model refuses
    (`selector` outside its Literal) fails in the worker before serve's own checks (which would answer that
    no session is open)."""
    import requests

    answer = requests.post(sglang_workers[0] + "/update_weights_from_tensor", timeout=60,
                           json={"serialized_named_tensors": ["eA=="], "selector": "everything"})
    assert answer.status_code >= 400 and "selector" in answer.text and "session" not in answer.text, answer.text


def test_a_keyed_request_passes_sglangs_sampling_params_and_draws_as_the_embedded_engine(tiny_model_dir, tokenizer,
                                                                                         tmp_path):
    """The client's sampling_seed (evaluation's keyed draws) reaches a worker through SGLang's GenerateReqInput and
    SamplingParams.verify, and the worker draws the tokens the embedded engine draws for the same key; SGLang's
    verify refuses a seed outside int64, as serve does."""
    from opd_sao.checkpoints import load_causal_lm
    from opd_sao.engines.base import GenerationRequest, SamplingParams
    from opd_sao.engines.embedded import EmbeddedEngine
    from opd_sao.engines.http import SGLangClient

    prompt = tokenizer("12+7=")["input_ids"]
    params = SamplingParams(1.5, 1.0, 8, ignore_eos=True, sampling_seed=77)
    port = free_port()
    with open(tmp_path / "worker.log", "w") as log:  # at policy version 0, as the client expects before any sync
        proc = subprocess.Popen([sys.executable, str(WORKER), str(tiny_model_dir), "--port", str(port), "--threads",
                                 "1", "--seed", "3", "--weight-version", "0"], stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(url, lambda: proc.poll() is None)
        served = SGLangClient(url, timeout=60.0).generate(GenerationRequest(prompt, params))
    finally:
        proc.kill()
        proc.wait()
    engine = EmbeddedEngine(load_causal_lm(tiny_model_dir), eos_id=tokenizer.eos_token_id,
                            pad_id=tokenizer.pad_token_id, seed=5)
    local = engine.generate_all([GenerationRequest(prompt, params)])[0]
    assert served.token_ids == local.token_ids and len(served.token_ids) == 8
    with pytest.raises(ValueError, match="sampling_seed"):
        sglang_code.verify_sampling_params({"sampling_seed": 2 ** 63}, 384)
