"""SGLang 0.5.23's pause and model-update lock rules (#42), as its tokenizer manager's own code applies them in front
of serve in the SGLang-semantics worker (tests/sglang_worker.py; the rules: tests/sglang_code.py's docstring), each
step ordered by that code's state (/server_info's `sglang_tokenizer_manager`), never by waiting a while."""
from __future__ import annotations

import threading
import time

import pytest
import requests
import torch
from launchers import SlowWorkers

from opd_sao.checkpoints import load_causal_lm
from opd_sao.engines.base import GenerationRequest, SamplingParams
from opd_sao.engines.fleet import Fleet

STEP_S = 0.05  # each decode step's added time: a 1000-token generation runs until it is aborted
# a serve whose /continue_generation answers as SGLang's does but leaves it paused
CONTINUE_WITHOUT_RESUMING = """
import runpy, sys
from opd_sao.engines.server import RolloutServer
RolloutServer.continue_generation = lambda self, body: {"message": "Generation continued successfully.", "status": "ok"}
sys.argv[0] = sys.argv.pop(1)
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="module")
def worker(tmp_path_factory, tiny_model_dir):
    """start(*patch) -> url: a slowed SGLang-semantics worker of the tiny model (`patch`: python -c code run first,
    then the worker), killed at the module's end."""
    workers = SlowWorkers(tmp_path_factory.mktemp("pause-rules-logs"), STEP_S)
    yield lambda *patch: workers.start(tiny_model_dir, patch=patch)
    workers.stop()


@pytest.fixture(scope="module")
def url(worker):
    return worker()


def _post(url, path, body, answers=None, name=None):
    answer = requests.post(url + path, json=body, timeout=600)
    if answers is not None:
        answers[name] = answer
    return answer


def _in_thread(*args) -> threading.Thread:
    thread = threading.Thread(target=_post, args=args, daemon=True)
    thread.start()
    return thread


def _manager(url) -> dict:
    """SGLang's tokenizer manager's pause and lock state (the worker's count of updates by pause aside)."""
    state = requests.get(url + "/server_info", timeout=60).json()["sglang_tokenizer_manager"]
    del state["updates"]
    return state


def _until(url, alive: list[threading.Thread], **state) -> None:
    """Until SGLang's tokenizer manager shows `state`, the `alive` calls still unanswered meanwhile."""
    while any(_manager(url)[k] != v for k, v in state.items()):
        assert all(t.is_alive() for t in alive), f"answered before SGLang's manager showed {state}: {_manager(url)}"
        time.sleep(0.02)


def _long(rid: str) -> dict:
    return {"input_ids": [1, 2, 3], "rid": rid, "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}


SHORT = {"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}


def test_a_generate_sent_while_paused_waits_for_continue_then_completes(url):
    """Mode abort answers the running request with finish_reason abort once none runs; a request sent while paused
    waits at SGLang's pause condition (not running on serve) until /continue_generation, then runs whole; a second
    continue, not paused, answers 200 as SGLang's does; mode retract is serve's 400 (not implemented)."""
    answers = {}
    running = _in_thread(url, "/generate", _long("paused-1"), answers, "running")
    _until(url, [running], readers=1)
    paused = _post(url, "/pause_generation", {"mode": "abort"})
    assert paused.status_code == 200 and paused.json() == {"message": "Generation paused successfully.", "status": "ok"}
    running.join()
    assert answers["running"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert _manager(url) == {"is_pause": True, "held": 0, "readers": 0, "writer_active": False, "waiting_writers": 0}
    sent = _in_thread(url, "/generate", SHORT, answers, "sent")
    _until(url, [sent], held=1)
    assert requests.get(url + "/v1/loads", timeout=60).json()["loads"][0]["num_running_reqs"] == 0
    resumed = _post(url, "/continue_generation", {})
    assert resumed.status_code == 200 and resumed.json() == {"message": "Generation continued successfully.",
                                                             "status": "ok"}
    sent.join()
    meta = answers["sent"].json()["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 2
    assert _post(url, "/continue_generation", {}).status_code == 200
    assert _manager(url)["is_pause"] is False
    assert _post(url, "/pause_generation", {"mode": "retract"}).status_code == 400
    assert _manager(url)["is_pause"] is False and _post(url, "/generate", SHORT).status_code == 200


def test_a_weight_update_without_a_pause_follows_sglangs_lock_order(url, tiny_model_dir):
    """No pause: an update waits (writer side) for the request running, a request sent after it waits behind it
    though the running one holds only the reader side, and the update runs once the running one ends (here
    aborted): the running request answers with the old weight_version, the one sent after with the new."""
    answers = {}
    old = requests.get(url + "/model_info", timeout=60).json()["weight_version"]
    running = _in_thread(url, "/generate", _long("lock-1"), answers, "running")
    _until(url, [running], readers=1)
    update = _in_thread(url, "/update_weights_from_disk", {"model_path": str(tiny_model_dir), "weight_version": "7"},
                        answers, "update")
    _until(url, [running, update], waiting_writers=1)
    after = _in_thread(url, "/generate", SHORT, answers, "after")
    _until(url, [running, update, after], held=1, readers=1, waiting_writers=1)
    assert requests.get(url + "/model_info", timeout=60).json()["weight_version"] == old
    assert _post(url, "/abort_request", {"rid": "lock-1"}).status_code == 200
    for thread in (running, update, after):
        thread.join()
    first, later = answers["running"].json()["meta_info"], answers["after"].json()["meta_info"]
    assert first["finish_reason"]["type"] == "abort" and first["weight_version"] == old
    assert answers["update"].json()["success"] is True
    assert later["finish_reason"]["type"] == "length" and later["weight_version"] == "7"


@pytest.mark.parametrize("mode", ["tensor", "distributed"])
def test_the_fleets_pause_sync_continue_passes_sglangs_rules(mode, worker, tiny_model_dir):
    """Two 200-token requests generating when a sync starts: the fleet's pause aborts both (SGLang's code polls
    until none holds its lock), the update runs while paused (no writer lock, nothing to wait for), continue lets
    the requests sent again in, and both come back whole on the new weights."""
    url = worker()
    model = load_causal_lm(tiny_model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    fleet = Fleet([url], max_inflight=2, weight_sync=mode)
    results = []
    runner = threading.Thread(target=fleet.generate, daemon=True, args=(
        [GenerationRequest([1, 2, 3 + i], SamplingParams(max_new_tokens=200, ignore_eos=True)) for i in range(2)],
        results.append))
    try:
        runner.start()
        _until(url, [runner], readers=2)
        fleet.update_weights(model.state_dict(), 1)
        assert requests.get(url + "/model_info", timeout=60).json()["weight_version"] == "1"
        runner.join()
        requeued = fleet.stats[url]["requeued"]
    finally:
        fleet.close()
    assert requeued == 2 and len(results) == 2
    assert all(r.versions == [1] * 200 and len(r.token_ids) == 200 for r in results), [r.versions for r in results]
    assert _manager(url) == {"is_pause": False, "held": 0, "readers": 0, "writer_active": False, "waiting_writers": 0}


def test_a_serve_whose_pause_differs_from_sglangs_is_caught(worker):
    """A serve whose /continue_generation answers but stays paused: SGLang's manager lets the next /generate in, and
    the worker fails it (HTTP 500) naming the disagreement, where a client would have waited for good."""
    url = worker("-c", CONTINUE_WITHOUT_RESUMING)
    assert _post(url, "/pause_generation", {}).status_code == 200
    assert _post(url, "/continue_generation", {}).status_code == 200
    refused = _post(url, "/generate", SHORT)
    assert refused.status_code == 500, refused.text
    assert "SGLang's tokenizer manager runs this request" in refused.text and "serve would hold it (paused)" in refused.text
