"""Weight syncs while requests generate (#42): the fleet pauses generation around a bucketed sync
(`/pause_generation` mode abort ... `/continue_generation`), so no trajectory samples from a mix of two
versions or carries a false weight_version, and no bucket waits for generation. Against a real
SGLang-semantics worker (tests/sglang_worker.py) slowed to real generation times (tests/slow_sglang_worker.py).
"""
from __future__ import annotations

import threading
import time

import pytest
import requests
import torch
from launchers import HANG_S, SlowWorkers, wait_until_healthy

from opd_sao.checkpoints import load_causal_lm
from opd_sao.engines.base import GenerationRequest, SamplingParams
from opd_sao.engines.fleet import Fleet
from opd_sao.engines.weight_sync import SyncSettings
from opd_sao.engines.weight_sync.base import buckets, untied
from opd_sao.errors import UsageError

STEP_S = 0.05  # each decode step's added time: a 24-token generation takes over a second


@pytest.fixture(scope="module")
def slow_worker(tmp_path_factory):
    """start(checkpoint, group_timeout_s) -> url: a slowed SGLang-semantics worker (killed at the module's end)."""
    workers = SlowWorkers(tmp_path_factory.mktemp("slow-worker-logs"), STEP_S)
    yield lambda checkpoint, group_timeout_s=30.0: workers.start(checkpoint, "--group-timeout-s", group_timeout_s)
    workers.stop()


def _version_states(tiny_model_dir, n: int) -> list[dict]:
    """n policies, each the tiny model with noise of its own (far enough apart that a mixed model's logprobs
    differ from every one of them)."""
    states = []
    for v in range(n):
        model = load_causal_lm(tiny_model_dir)
        gen = torch.Generator().manual_seed(v)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05 * (v > 0))
        states.append({k: t.clone() for k, t in model.state_dict().items()})
    return states


def _check_sampled_by(results, states, tiny_model_dir):
    """Every trajectory's tokens carry one version, and their logprobs are that version's (recomputed)."""
    model = load_causal_lm(tiny_model_dir)
    for result in results:
        assert len(set(result.versions)) == 1, result.versions
        model.load_state_dict(states[result.versions[0]])
        ids = list(result.request.prompt_ids) + list(result.token_ids)
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        start = len(result.request.prompt_ids)
        recomputed = [float(logp[start + i - 1, t]) for i, t in enumerate(result.token_ids)]
        assert recomputed == pytest.approx(result.vocab_logprobs, abs=2e-3), (result.versions[0], result.token_ids)


def _bucket_bytes_for(state: dict, n: int) -> int:
    """The bucket size that splits `state` into n buckets."""
    tensors, size = untied(state), 512
    while len(buckets(tensors, size)) > n:  # fewer buckets as they grow
        size += 512
    assert len(buckets(tensors, size)) == n
    return size


@pytest.mark.parametrize("mode", ["tensor", "distributed"])
def test_a_sync_while_requests_generate_pauses_them_and_no_bucket_waits_for_generation(
        mode, slow_worker, tiny_model_dir):
    """Syncs of 1 and 8 buckets, alternating, each while 8 requests generate: every returned trajectory was
    sampled by the one version it is labelled with (logprobs recomputed under it), requests aborted by the
    pause come back whole on the new weights, and every bucket reached the worker while SGLang's tokenizer manager
    was paused (the worker counts them): unpaused, SGLang's code takes its update lock, which waits for every
    running generation, so without the pause a sync's time grew with its buckets (about 8x at 8). Counted, not
    timed: a busy machine cannot change it."""
    url = slow_worker(tiny_model_dir)
    states = _version_states(tiny_model_dir, 5)
    one, eight = 1 << 30, _bucket_bytes_for(states[0], 8)
    sync = SyncSettings(bucket_bytes=one)
    fleet = Fleet([url], max_inflight=8, weight_sync=mode, sync=sync)
    fleet.update_weights(states[0], 0)
    results, stop = [], threading.Event()

    def requests_():
        i = 0
        while not stop.is_set():
            i += 1
            yield GenerationRequest([1 + i % 7, 2, 3], SamplingParams(max_new_tokens=24, ignore_eos=True))

    runner = threading.Thread(target=fleet.generate, args=(requests_(), results.append), daemon=True)
    generated = lambda: requests.get(url + "/server_info", timeout=60).json()["tokens_generated"]
    runner.start()
    updates = lambda: requests.get(url + "/server_info", timeout=60).json()["sglang_tokenizer_manager"]["updates"]
    updates_before = updates()
    try:
        for version, size in enumerate([one, eight, one, eight], start=1):
            while fleet.stats[url]["inflight"] < 8 or not any(r.versions[0] == version - 1 for r in results):
                time.sleep(0.05)  # trajectories of the current version done, and a full batch generating
            before = generated()
            while generated() < before + 8 * 5:  # a few decode steps into the batch
                time.sleep(0.05)
            sync.bucket_bytes = size
            fleet.update_weights(states[version], version)
            assert requests.get(url + "/model_info", timeout=10).json()["weight_version"] == str(version)
        while not any(r.versions[0] == 4 for r in results):
            time.sleep(0.05)
    finally:
        stop.set()
        runner.join(60)
        fleet.close()
    assert {r.versions[0] for r in results} == {0, 1, 2, 3, 4}
    after = updates()  # a load per bucket, every one while SGLang's manager was paused
    assert (after["paused"] - updates_before["paused"], after["unpaused"] - updates_before["unpaused"]) == \
        (1 + 8 + 1 + 8, 0), (updates_before, after)
    _check_sampled_by(results, states, tiny_model_dir)


def _check_spans(result, states, model, old: int):
    """`result` holds version `old`'s tokens, then version old + 1's, each with the logprobs its version gives it
    over prompt + every token before it (the continuation's prompt was prompt + prefix, exact ids)."""
    boundary = result.versions.count(old)
    assert result.versions == [old] * boundary + [old + 1] * (len(result.token_ids) - boundary), result.versions
    ids = list(result.request.prompt_ids) + list(result.token_ids)
    start = len(result.request.prompt_ids)
    for version in (old, old + 1):
        model.load_state_dict(states[version])
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        span = [i for i, v in enumerate(result.versions) if v == version]
        recomputed = [float(logp[start + i - 1, result.token_ids[i]]) for i in span]
        assert recomputed == pytest.approx([result.vocab_logprobs[i] for i in span], abs=2e-3), (version, span)


# Tokens per request of the partial-rollouts test: the sync must land before they are done, and starts 5 tokens in,
# so 195 decode steps (10 s at STEP_S, more on a busy machine) from their end. At 40 (1.75 s) a sync that took
# longer to reach the worker found them finished.
TOKENS = 200


def _sync_mid_generation(url, mode, states, old: int, partial: bool):
    """4 requests of TOKENS tokens on a fleet at version `old`; once each has 5, a sync to old + 1. Returns
    (their results, the fleet)."""
    fleet = Fleet([url], max_inflight=4, weight_sync=mode, sync=SyncSettings(bucket_bytes=64 << 10),
                  partial_rollouts=partial)
    fleet.update_weights(states[old], old)
    results = []
    batch = [GenerationRequest([1 + i, 2, 3], SamplingParams(max_new_tokens=TOKENS, ignore_eos=True))
             for i in range(4)]
    runner = threading.Thread(target=fleet.generate, args=(iter(batch), results.append), daemon=True)
    generated = lambda: requests.get(url + "/server_info", timeout=HANG_S).json()["tokens_generated"]
    try:
        before = generated()
        runner.start()
        while generated() < before + 4 * 5:  # every request has tokens (a batch decodes together)
            time.sleep(0.05)
        fleet.update_weights(states[old + 1], old + 1)
        runner.join(HANG_S)
    finally:
        fleet.close()
    assert sorted(id(r.request) for r in results) == sorted(id(r) for r in batch)
    assert all(len(r.token_ids) == len(r.logprobs) == len(r.versions) == TOKENS for r in results)
    return results, fleet


@pytest.mark.parametrize("mode", ["tensor", "distributed"])
def test_partial_rollouts_keep_an_aborted_prefix_and_record_each_spans_version(mode, slow_worker, tiny_model_dir):
    """A sync while 4 requests generate TOKENS tokens each aborts them (the pause). Off (the default): each comes
    back whole on the new version, and the tokens the abort returned are counted as thrown away. With
    engine.partial_rollouts each continues on the new weights from prompt + the tokens it had, and its result
    holds two spans, the old version then the new, split where the abort came, each token's logprob its own
    version's (recomputed over the exact ids: a retokenised or wrong continuation prompt would change them)."""
    url = slow_worker(tiny_model_dir)
    states = _version_states(tiny_model_dir, 4)
    model = load_causal_lm(tiny_model_dir)
    whole, fleet = _sync_mid_generation(url, mode, states, 0, partial=False)
    assert all(r.versions == [1] * TOKENS for r in whole) and fleet.tokens_continued == 0
    assert fleet.tokens_discarded >= 4 * 5
    _check_sampled_by(whole, states, tiny_model_dir)
    kept, fleet = _sync_mid_generation(url, mode, states, 2, partial=True)
    boundaries = [r.versions.count(2) for r in kept]
    assert all(0 < b < TOKENS for b in boundaries), boundaries
    assert fleet.tokens_continued == sum(boundaries) and fleet.tokens_discarded == 0
    for result in kept:
        _check_spans(result, states, model, 2)


def test_a_distributed_sync_during_a_long_generation_aborts_it_instead_of_waiting_for_it(
        slow_worker, tiny_model_dir):
    """A 200-token generation (10 s at 50 ms a step) is in flight when a distributed sync starts: the pause
    aborts it (its tokens so far are counted thrown away), the broadcast runs at once, and the request comes
    back whole on the new weights. Before, the broadcast waited for the generation to drain (a 90 s generation
    failed the 60 s broadcast timeout); a sync that waits would return it whole on the old version. Ordered by
    the worker's token count, not timed (a short broadcast timeout would fail on a busy machine)."""
    url = slow_worker(tiny_model_dir)
    states = _version_states(tiny_model_dir, 2)
    fleet = Fleet([url], max_inflight=8, weight_sync="distributed", sync=SyncSettings(bucket_bytes=64 << 10))
    fleet.update_weights(states[0], 0)
    results = []
    runner = threading.Thread(target=fleet.generate, daemon=True, args=(
        [GenerationRequest([1, 2, 3], SamplingParams(max_new_tokens=200, ignore_eos=True))], results.append))
    generated = lambda: requests.get(url + "/server_info", timeout=60).json()["tokens_generated"]
    try:
        before = generated()
        runner.start()
        while generated() < before + 5:  # into the generation, 195 steps (10 s at least) from its end
            time.sleep(0.05)
        fleet.update_weights(states[1], 1)
        runner.join()
    finally:
        fleet.close()
    assert fleet.tokens_discarded >= 5
    assert len(results) == 1 and results[0].versions == [1] * 200 and len(results[0].token_ids) == 200
    _check_sampled_by(results, states, tiny_model_dir)


def test_a_worker_given_an_unreachable_master_address_is_refused_in_one_line_before_any_step(
        slow_worker, tiny_model_dir):
    """198.51.100.1 (TEST-NET-2) is no address of this machine: the worker cannot join the group there, and
    the fleet's first sync (the start weights, before any step) stops in one line naming the setting."""
    url = slow_worker(tiny_model_dir, group_timeout_s=3.0)
    with pytest.raises(UsageError) as refused:
        Fleet([url], checkpoint=tiny_model_dir, weight_sync="distributed",
              sync=SyncSettings(address="198.51.100.1", group_timeout_s=3.0))
    assert "engine.weight_sync_address" in str(refused.value) and "\n" not in str(refused.value), refused.value


def test_the_master_address_reaches_the_workers_or_is_refused():
    from opd_sao.engines.weight_sync.distributed import master_address

    assert master_address(None, ["http://127.0.0.1:30000", "http://localhost:1"]) == "127.0.0.1"
    assert master_address("10.0.0.5", ["http://10.0.0.6:30000"]) == "10.0.0.5"
    with pytest.raises(UsageError, match="loopback, which rollout worker http://10.1.2.3:30000 cannot reach"):
        master_address("127.0.0.1", ["http://127.0.0.1:1", "http://10.1.2.3:30000"])
    auto = master_address(None, ["http://192.0.2.77:30000"])  # the address on this machine's route there
    assert auto and auto != "127.0.0.1"


def _call(url, method, path, key=None, **kwargs):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.request(method, url + path, headers=headers, timeout=60, **kwargs)


def test_serve_answers_the_ten_requests_a_sglang_client_most_sends_as_sglang_does(start_server, tiny_model_dir):
    """SGLang 0.5.23's status codes and shapes (entrypoints/http_server.py, v1_loads.py, utils/auth.py) for:
    1 /health, 2 /model_info, 3 /server_info, 4 /generate (with a top-level key serve does not know, which
    SGLang ignores), 5 /flush_cache, 6 /pause_generation, 7 /update_weights_from_disk, 8 /continue_generation,
    9 /abort_request, 10 /v1/loads; and a request without the key: 401 {"error": "Unauthorized"}."""
    url, proc = start_server(tiny_model_dir, "--api-key", "user", "--admin-api-key", "admin")
    wait_until_healthy(url, lambda: proc.poll() is None)
    health = _call(url, "GET", "/health")
    assert health.status_code == 200 and health.content == b""
    info = _call(url, "GET", "/model_info", "user").json()
    assert info["weight_version"] == "default" and info["model_path"] == str(tiny_model_dir)
    assert _call(url, "GET", "/server_info", "user").json()["tp_size"] == 1
    generated = _call(url, "POST", "/generate", "user", json={
        "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}, "return_logprob": True,
        "a_newer_sglang_field": {"anything": 1}})
    assert generated.status_code == 200 and len(generated.json()["meta_info"]["output_token_logprobs"]) == 3
    flushed = _call(url, "POST", "/flush_cache", "admin")
    assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed.\n")
    paused = _call(url, "POST", "/pause_generation", "admin", json={"mode": "abort"})
    assert paused.status_code == 200 and paused.json() == {"message": "Generation paused successfully.", "status": "ok"}
    updated = _call(url, "POST", "/update_weights_from_disk", "admin",
                    json={"model_path": str(tiny_model_dir), "weight_version": "1"})
    assert updated.status_code == 200 and updated.json()["success"] is True
    resumed = _call(url, "POST", "/continue_generation", "admin", json={})
    assert resumed.status_code == 200 and resumed.json() == {"message": "Generation continued successfully.",
                                                             "status": "ok"}
    aborted = _call(url, "POST", "/abort_request", "admin", json={"rid": "nothing-running"})
    assert aborted.status_code == 200 and aborted.content == b""
    loads = _call(url, "GET", "/v1/loads", "user").json()
    assert loads["loads"][0]["dp_rank"] == 0 and loads["loads"][0]["num_running_reqs"] == 0
    refused = _call(url, "POST", "/generate", None, json={"input_ids": [1]})
    assert refused.status_code == 401 and refused.json() == {"error": "Unauthorized"}
    assert _call(url, "POST", "/pause_generation", "user", json={}).status_code == 401  # an admin route
    assert _call(url, "GET", "/model_info", "user").json()["weight_version"] == "1"


def test_serve_aborts_running_requests_and_holds_new_ones_while_paused(start_server, tiny_model_dir):
    """/abort_request by rid prefix answers a running generation 200 with finish_reason abort (as SGLang's
    scheduler does); /pause_generation aborts what runs, and a request sent while paused waits for
    /continue_generation, then runs whole."""
    url, proc = start_server(tiny_model_dir)
    wait_until_healthy(url, lambda: proc.poll() is None)
    long = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}
    answers = {}

    def send(name, body):
        answers[name] = _call(url, "POST", "/generate", json=body)

    def running(n):
        while _call(url, "GET", "/v1/loads").json()["loads"][0]["num_running_reqs"] < n:
            time.sleep(0.01)

    first = threading.Thread(target=send, args=("by-rid", {**long, "rid": "long-1"}))
    first.start()
    running(1)
    assert _call(url, "POST", "/abort_request", json={"rid": "long"}).status_code == 200
    first.join(60)
    assert answers["by-rid"].json()["meta_info"]["finish_reason"]["type"] == "abort"

    second = threading.Thread(target=send, args=("by-pause", {**long, "return_logprob": True}))
    generated = _call(url, "GET", "/server_info").json()["tokens_generated"]
    second.start()
    running(1)
    while _call(url, "GET", "/server_info").json()["tokens_generated"] < generated + 3:
        time.sleep(0.01)
    assert _call(url, "POST", "/pause_generation", json={}).status_code == 200  # answers once none runs
    second.join(60)
    by_pause = answers["by-pause"].json()
    assert by_pause["meta_info"]["finish_reason"]["type"] == "abort"
    # with the tokens it had generated, as SGLang's scheduler answers a running request's abort (partial rollouts)
    kept = by_pause["output_ids"]
    assert len(kept) >= 3 and by_pause["meta_info"]["completion_tokens"] == len(kept)
    assert [p[1] for p in by_pause["meta_info"]["output_token_logprobs"]] == kept
    third = threading.Thread(target=send, args=("held", {**long, "sampling_params": {"max_new_tokens": 2}}))
    third.start()
    time.sleep(1.0)
    assert third.is_alive()  # held while paused
    assert _call(url, "POST", "/continue_generation", json={}).status_code == 200
    third.join(60)
    assert answers["held"].json()["meta_info"]["finish_reason"]["type"] == "length"


def test_serves_body_limit_takes_the_largest_default_bucket_as_base64():
    from opd_sao.engines.server import MAX_BODY_BYTES
    from opd_sao.engines.weight_sync.base import BUCKET_BYTES

    assert MAX_BODY_BYTES > 4 * -(-BUCKET_BYTES // 3) + (1 << 20)  # its base64, and the JSON around it


def test_the_fleet_reads_the_routers_workers_again_before_each_sync(start_server, tiny_model_dir):
    """sglang-router 0.3.2 in front of worker A; B is added to the router (POST /workers), then A removed
    (DELETE /workers/{id}): each next sync reaches the router's workers of the moment, and only those."""
    from launchers import start_sglang_router

    (a, proc_a), (b, proc_b) = start_server(tiny_model_dir), start_server(tiny_model_dir)
    for url, proc in ((a, proc_a), (b, proc_b)):
        wait_until_healthy(url, lambda proc=proc: proc.poll() is None)
    router, router_proc = start_sglang_router([a])
    state = load_causal_lm(tiny_model_dir).state_dict()

    def router_lists(n):  # no deadline of ours: pytest's timeout is the backstop
        while len(requests.get(router + "/workers", timeout=60).json()["workers"]) != n:
            time.sleep(0.2)

    try:
        fleet = Fleet(router, checkpoint=tiny_model_dir, weight_sync="tensor")
        assert fleet.workers == [a]
        assert requests.post(router + "/workers", json={"url": b}, timeout=10).status_code == 202
        router_lists(2)
        fleet.update_weights(state, 1)
        assert sorted(fleet.workers) == sorted([a, b])
        assert [requests.get(u + "/model_info", timeout=10).json()["weight_version"] for u in (a, b)] == ["1", "1"]
        listed = requests.get(router + "/workers", timeout=10).json()["workers"]
        worker_id = next(w["id"] for w in listed if w["url"] == a)
        assert requests.delete(f"{router}/workers/{worker_id}", timeout=10).status_code == 202
        router_lists(1)
        fleet.update_weights(state, 2)
        assert fleet.workers == [b]
        assert [requests.get(u + "/model_info", timeout=10).json()["weight_version"] for u in (a, b)] == ["1", "2"]
        fleet.close()
    finally:
        router_proc.kill()
        router_proc.wait()
