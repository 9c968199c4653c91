"""Hostile and careless input against a real `opd-sao serve` on loopback, and faults between it and the HTTP
engine: no request poisons the server, malformed requests get a 4xx (never a 500 or a hang), abandoned
requests stop decoding, and a transient network fault never takes a server out of a run.
"""
from __future__ import annotations

import importlib.util
import json
import math
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch
from launchers import HANG_S, free_port, wait_until_healthy

from opd_sao.engines.base import GenerationRequest, SamplingParams

MAX_NEW_TOKENS = 1000  # the server's cap in these tests (the tiny model has 1024 positions)


@pytest.fixture(scope="module")
def server(tiny_model_dir, start_server):
    url, proc = start_server(tiny_model_dir, "--max-batch", 4, "--max-new-tokens", MAX_NEW_TOKENS)
    wait_until_healthy(url, lambda: proc.poll() is None)
    yield url
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return [tokenizer.bos_token_id] + tokenizer.encode("12+7=", add_special_tokens=False)


def _generate(url, prompt, timeout=30, **sampling):
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True, **sampling}}
    return requests.post(url + "/generate", data=json.dumps(body), timeout=timeout,  # NaN and Infinity as Python writes them
                         headers={"Content-Type": "application/json"})


def _assert_still_serving(url, prompt):
    assert requests.get(url + "/health", timeout=10).status_code == 200
    ok = _generate(url, prompt)
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 4


@pytest.mark.parametrize("sampling", [{"temperature": math.nan}, {"temperature": -0.5}, {"temperature": math.inf},
                                      {"top_p": math.nan}, {"top_p": 0.0}, {"temperature": "hot"}, {"top_k": 0},
                                      {"stop_token_ids": [10 ** 9]}, {"stop": [""]}, {"min_p": 0.1}],
                         ids=["temperature-nan", "temperature-negative", "temperature-inf", "top_p-nan", "top_p-0",
                              "temperature-str", "top_k-0", "stop_token_ids-out-of-vocab", "stop-empty", "min_p"])
def test_a_bad_sampling_parameter_is_a_400_and_poisons_nothing(server, prompt, sampling):
    bad = _generate(server, prompt, **sampling)
    assert bad.status_code == 400, bad.text
    assert next(iter(sampling)) in bad.json()["error"]["message"]
    _assert_still_serving(server, prompt)


def test_a_prompt_past_the_models_positions_is_a_400(server, prompt):
    huge = _generate(server, [prompt[0]] + [5] * 99_999, max_new_tokens=1)
    assert huge.status_code == 400 and "1024" in huge.json()["error"]["message"], huge.text
    over = _generate(server, [prompt[0]] + [5] * 999, max_new_tokens=100)  # 1000 + 100 > 1024
    assert over.status_code == 400 and "max_new_tokens" in over.json()["error"]["message"], over.text
    _assert_still_serving(server, prompt)


def test_max_new_tokens_is_capped_by_the_server_option(server, prompt):
    capped = _generate(server, prompt, max_new_tokens=MAX_NEW_TOKENS + 1)
    assert capped.status_code == 400 and "--max-new-tokens" in capped.json()["error"]["message"], capped.text


@pytest.mark.parametrize("body,named", [
    ({"input_ids": "P2", "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": MAX_NEW_TOKENS + 1}]},
     "--max-new-tokens"),
    ({"input_ids": ["P", [1] + [5] * 1100], "sampling_params": {"max_new_tokens": 1}}, "1024"),
    ({"text": ["1+1=", "12+7=" * 20], "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS}}, "positions"),
    ({"input_ids": ["P", [True]]}, "input_ids"),
    ({"input_ids": "P2", "rid": ["a"]}, "rid"),
    ({"input_ids": "P2", "sampling_params": [{}, {"temperature": math.nan}]}, "temperature"),
], ids=["cap", "positions-ids", "positions-text", "ids-bool", "rid-count", "temperature-nan"])
def test_every_prompt_of_a_batch_is_checked_before_any_of_it_runs(server, prompt, body, named):
    """A batch (a list of input_ids lists or of texts) gets each prompt checked like a single request."""
    ids = body.get("input_ids")
    body = {**body, "input_ids": [prompt, prompt] if ids == "P2" else [prompt if p == "P" else p for p in ids]} \
        if ids is not None else body
    bad = requests.post(server + "/generate", data=json.dumps(body), headers={"Content-Type": "application/json"},
                        timeout=30)
    assert bad.status_code == 400 and named in bad.json()["error"]["message"], bad.text
    _assert_still_serving(server, prompt)


def test_weight_update_requests_are_checked_and_bounded(server, prompt):
    """Weight endpoints answer a bad field with 400 (SGLang's {"success": false}), before joining or waiting
    for any collective; /update_weights_from_tensor's body is capped by --max-body-mb like every body."""
    from opd_sao.engines.server import MAX_BODY_BYTES

    for path, body, named in [
            ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": "x", "rank_offset": 1,
                                            "world_size": 2}, "master_port"),
            ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0,
                                            "world_size": 2}, "rank_offset"),
            ("/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]}, "session"),
            ("/update_weights_from_tensor", {"serialized_named_tensors": ["not base64!"]}, "session"),
            ("/begin_weight_update", {}, "Success"),
            ("/update_weights_from_tensor", {"serialized_named_tensors": ["not base64!"]}, "serialized_named_tensors"),
            ("/update_weights_from_tensor", {"serialized_named_tensors": ["eA=="], "load_format": "safetensors"},
             "load_format")]:
        bad = requests.post(server + path, json=body, timeout=30)
        if named == "Success":  # a weight-update session is open (SGLang loads tensors only inside one)
            assert bad.json()["success"], bad.text
            continue
        assert bad.status_code == 400 and not bad.json()["success"] and named in bad.json()["message"], bad.text
    assert requests.post(server + "/end_weight_update", json={}, timeout=30).json()["success"]
    head = ("POST /update_weights_from_tensor HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {MAX_BODY_BYTES + 1}\r\n")
    assert _raw_request(server, head) == 413
    _assert_still_serving(server, prompt)


@pytest.mark.parametrize("raw", [
    "[1, 2, 3]",
    '"input_ids"',
    '{"input_ids": %(p)s, "sampling_params": [1]}',
    '{"input_ids": %(p)s, "sampling_params": []}',
    '{"input_ids": %(p)s, "sampling_params": {"max_new_tokens": 1e309}}',
    '{"input_ids": %(p)s, "sampling_params": {"max_new_tokens": 2.5}}',
    '{"input_ids": %(p)s, "sampling_params": {"max_new_tokens": -1}}',
    '{"input_ids": %(p)s, "sampling_params": {"max_new_tokens": 0}, "return_logprob": true, '
    '"logprob_start_len": 1, "top_logprobs_num": -5}',
    '{"input_ids": %(p)s, "sampling_params": {"max_new_tokens": 0}, "return_logprob": true, '
    '"logprob_start_len": "one"}',
    '{"input_ids": %(p)s, "sampling_params": {"ignore_eos": "yes"}}',
    '{"input_ids": [true, 5]}',
    '{"input_ids": %(p)s, "return_logprob": 7}',
], ids=["list", "string", "sp-list", "sp-empty-list", "max-new-1e309", "max-new-2.5", "max-new--1", "top-logprobs--5",
        "logprob-start-str", "ignore-eos-str", "ids-bool", "return-logprob-int"])
def test_a_malformed_body_is_a_400(server, prompt, raw):
    bad = requests.post(server + "/generate", data=raw % {"p": json.dumps(prompt)},
                        headers={"Content-Type": "application/json"}, timeout=30)
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["message"]
    _assert_still_serving(server, prompt)


def _raw_request(url: str, head: str, body: bytes = b"", timeout: float = 10.0) -> int:
    """Send a hand-written HTTP request; the status code of the answer (socket.timeout if none comes)."""
    host, port = url.rsplit("/", 1)[-1].split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(head.encode() + b"\r\n" + body)
        answer = b""
        while b"\r\n" not in answer:
            chunk = sock.recv(4096)
            if not chunk:
                raise ConnectionError(f"connection closed with no answer (got {answer!r})")
            answer += chunk
    return int(answer.split()[1])


@pytest.mark.parametrize("length,expected", [("abc", 400), ("-1", 400), ("1e3", 400), (str(10 ** 12), 413),
                                             (None, 400)])
def test_a_bad_content_length_is_a_4xx_not_a_hang(server, prompt, length, expected):
    """None: no Content-Length, so an empty body (which names the missing input_ids)."""
    head = "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    if length is not None:
        head += f"Content-Length: {length}\r\n"
    assert _raw_request(server, head, b'{"input_ids": [1]}') == expected
    _assert_still_serving(server, prompt)


def test_a_chunked_body_is_refused_not_misread(server, prompt):
    head = "POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
    assert _raw_request(server, head, b"5\r\nhello\r\n0\r\n\r\n") == 411
    _assert_still_serving(server, prompt)


def test_fifty_concurrent_connections_are_all_answered(server, prompt):
    start = threading.Barrier(50)

    def one(_):
        start.wait()
        try:  # a fresh connection each: the burst hits the listen backlog at once
            return requests.post(server + "/generate", json={"input_ids": prompt, "sampling_params": {
                "max_new_tokens": 2, "ignore_eos": True}}, timeout=120).status_code
        except requests.ConnectionError as err:
            return type(err).__name__

    with ThreadPoolExecutor(50) as pool:
        codes = list(pool.map(one, range(50)))
    assert codes == [200] * 50


def test_the_load_loop_answers_valid_requests_and_refuses_invalid_ones(server):
    """benchmarks/serve_load.py's loop, small: every valid request a 200 with the right tokens, every invalid
    one a 4xx, /health 200 at every poll, the server serving afterwards."""
    spec = importlib.util.spec_from_file_location("serve_load", Path(__file__).parents[1] / "benchmarks" / "serve_load.py")
    serve_load = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve_load)
    report = serve_load.run_load(server, n_requests=80, concurrency=40, cap=MAX_NEW_TOKENS)
    assert report["valid"]["answered"] == report["valid"]["sent"] > 0
    assert report["invalid"]["4xx"] == report["invalid"]["sent"] > 0, report["invalid"]["not_4xx"]
    assert report["health"]["failures"] == 0 and report["health"]["polls"] > 0 and report["serving_after"]


def test_abandoned_requests_stop_decoding(server, prompt):
    """40 clients ask for 1000 tokens each and hang up; the engine (4 slots) would decode for 10,000 steps.
    A request that comes next is answered before them: the abandoned ones were cancelled. Counted in tokens, not
    seconds (a loaded machine decodes slowly either way): queued first (the engine takes requests in order), 36 of
    them would have to finish, 36,000 tokens, before it got a slot."""
    head = ("POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n")
    body = json.dumps({"input_ids": prompt, "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}).encode()
    host, port = server.rsplit("/", 1)[-1].split(":")
    generated = lambda: requests.get(server + "/server_info", timeout=60).json()["tokens_generated"]
    before = generated()
    for _ in range(40):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(head.format(len(body)).encode() + b"\r\n" + body)
    time.sleep(0.5)  # the 40 are read before the next one (only how sharp the check is depends on it, not its pass)
    _assert_still_serving(server, prompt)
    assert generated() - before < 36 * 1000


# --- the embedded engine: one failing request in the continuous batch ----------------------------------------

def test_a_request_failing_in_the_batch_alone_gets_the_error(tiny_model_dir, tokenizer, prompt):
    from opd_sao.checkpoints import load_causal_lm
    from opd_sao.engines.embedded import EmbeddedEngine

    engine = EmbeddedEngine(load_causal_lm(tiny_model_dir), eos_id=tokenizer.eos_token_id,
                            pad_id=tokenizer.pad_token_id, max_batch=4)
    good = [GenerationRequest(prompt, SamplingParams(0.9, 1.0, 5 + i, ignore_eos=True)) for i in range(3)]
    poisoned = GenerationRequest(prompt, SamplingParams(math.nan, 1.0, 5, ignore_eos=True))
    results, failed = [], []
    engine.generate(iter([good[0], poisoned, good[1], good[2]]), results.append,
                    on_error=lambda request, err: failed.append((request, err)))
    assert [r.request for r in results] and sorted(len(r.token_ids) for r in results) == [5, 6, 7]
    assert len(failed) == 1 and failed[0][0] is poisoned
    with pytest.raises(RuntimeError):  # without on_error a failure still stops generate (in-process runs)
        engine.generate(iter([poisoned]), results.append)


def test_cancelled_requests_leave_the_batch(tiny_model_dir, tokenizer, prompt):
    from opd_sao.checkpoints import load_causal_lm
    from opd_sao.engines.embedded import EmbeddedEngine

    engine = EmbeddedEngine(load_causal_lm(tiny_model_dir), eos_id=tokenizer.eos_token_id,
                            pad_id=tokenizer.pad_token_id, max_batch=4)
    long = [GenerationRequest(prompt, SamplingParams(max_new_tokens=200, ignore_eos=True)) for _ in range(3)]
    short = GenerationRequest(prompt, SamplingParams(max_new_tokens=20, ignore_eos=True))
    results = []

    def on_result(result):
        results.append(result)
        for request in long[1:]:  # the short one is done: its neighbours' clients hang up
            request.cancelled = True

    engine.generate(iter(long + [short]), on_result)
    assert [len(r.token_ids) for r in results] == [20, 200]
    assert engine.tokens_generated < 20 * 4 + 200 + 10


# --- the HTTP engine: transient faults are retried, dead servers come back ------------------------------------

class FaultyProxy:
    """A loopback TCP forwarder to a server that resets the next `reset_next` connections (or every one while
    `down`) right after reading the request: the client sees "connection reset by peer"; then answers the
    next `unavailable_next` requests with HTTP 503, as a load balancer in front of a busy server would."""

    def __init__(self, target: str):
        host, port = target.rsplit("/", 1)[-1].split(":")
        self.target = (host, int(port))
        self.reset_next, self.unavailable_next, self.down, self.resets = 0, 0, False, 0
        self.piped: list[socket.socket] = []  # the open connections to the server
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            if self.down or self.reset_next > 0:
                self.reset_next -= 1
                self.resets += 1
                conn.settimeout(5)
                try:
                    conn.recv(65536)
                except OSError:
                    pass
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                conn.close()  # linger 0: a TCP reset
                continue
            if self.unavailable_next > 0:
                self.unavailable_next -= 1
                with conn:
                    conn.recv(65536)
                    conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                continue
            upstream = socket.create_connection(self.target)
            self.piped += [conn, upstream]
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src, dst) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def crash(self) -> None:
        """The server goes away as a crashed process does: open connections drop, new ones are reset."""
        self.down = True
        for sock in self.piped:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.piped.clear()

    def close(self) -> None:
        self.listener.close()


def test_a_one_server_run_survives_a_transient_reset(server, tiny_model_dir, prompt):
    from opd_sao.engines.fleet import Fleet

    proxy = FaultyProxy(server)
    # 4 faults could all land on one request (4 attempts at the default 3 retries) when the others are slow to
    # come back, as on a loaded machine: then that request fails and /health decides; with 6 retries every
    # distribution of the faults over the requests is absorbed by the retries alone
    engine = Fleet(proxy.url, checkpoint=tiny_model_dir, max_inflight=4, retries=6)
    proxy.reset_next, proxy.unavailable_next = 2, 2
    results = engine.generate_all([GenerationRequest(prompt, SamplingParams(max_new_tokens=3, ignore_eos=True))
                                   for _ in range(6)])
    assert [len(r.token_ids) for r in results] == [3] * 6
    assert proxy.resets == 2 and proxy.unavailable_next == 0
    stats = engine.stats[proxy.url]
    assert stats["alive"] and stats["revived"] == 0  # retried, never declared dead
    engine.close()
    proxy.close()


@pytest.mark.parametrize("sync", ["disk", "tensor", "distributed"])
def test_a_dead_server_is_brought_back_when_its_health_recovers(server, tiny_model_dir, prompt, sync):
    """It gets the current weights back the way the engine syncs them (distributed: a new group with it)."""
    from opd_sao.engines.fleet import Fleet

    proxy = FaultyProxy(server)
    engine = Fleet(proxy.url, checkpoint=tiny_model_dir, max_inflight=4, weight_sync=sync)
    engine.update_weights(engine_state(tiny_model_dir), 3)
    proxy.down = True
    # while it is unreachable it "restarts": back at the start checkpoint, version 0
    requests.post(server + "/update_weights_from_disk", json={"model_path": str(tiny_model_dir),
                                                              "weight_version": "0"}, timeout=30).raise_for_status()
    threading.Timer(3.0, lambda: setattr(proxy, "down", False)).start()
    results = engine.generate_all([GenerationRequest(prompt, SamplingParams(max_new_tokens=3, ignore_eos=True))
                                   for _ in range(4)])
    stats = engine.stats[proxy.url]
    assert [r.versions for r in results] == [[3] * 3] * 4  # the revived server got the current weights back
    assert stats["alive"] and stats["revived"] == 1 and stats["requeued"] >= 1
    assert requests.get(server + "/get_model_info", timeout=10).json()["weight_version"] == "3"
    engine.close()
    proxy.close()


def test_the_gate_checks_again_after_a_server_rejoins(server, tiny_model_dir, tokenizer, prompt, tmp_path):
    """A restarted server given the weights back is a new inference stack: the next step is gated on it, with
    periodic checks off, and only once per rejoin."""
    from opd_sao.config import GateConfig, RolloutConfig, TrainerConfig
    from opd_sao.consistency.gate import ConsistencyGate, probe_episodes
    from opd_sao.engines.fleet import Fleet
    from opd_sao.envs import ENVIRONMENTS
    from opd_sao.trainers.torch_backend import TorchTrainer

    proxy = FaultyProxy(server)
    engine = Fleet(proxy.url, checkpoint=tiny_model_dir, max_inflight=4)
    trainer = TorchTrainer(tiny_model_dir, TrainerConfig(), with_critic=False)
    probe = lambda: probe_episodes(ENVIRONMENTS.get("arithmetic"), tokenizer,
                                   RolloutConfig(max_new_tokens=4), domain="arithmetic", n=2, seed=0)
    gate = ConsistencyGate(GateConfig(every=0), stage="probe", out_dir=tmp_path, engine=engine, backend=trainer,
                           make_probe=probe, eps_low=0.3, eps_high=5.0, pad_id=tokenizer.pad_token_id)
    gate.run("start")
    gate.after_step(1)
    assert [e["phase"] for e in gate.evaluations] == ["start"] and engine.rejoins == 0
    proxy.crash()
    threading.Timer(3.0, lambda: setattr(proxy, "down", False)).start()
    engine.generate_all([GenerationRequest(prompt, SamplingParams(max_new_tokens=3, ignore_eos=True))])
    assert engine.rejoins == 1
    gate.after_step(2)
    gate.after_step(3)
    assert [(e["phase"], e["step"], e["passed"]) for e in gate.evaluations] == [("start", None, True),
                                                                              ("rejoin", 2, True)]
    engine.close()
    proxy.close()


def test_a_timed_out_request_is_sent_again_and_its_healthy_server_kept(server, prompt):
    """A read timeout is not retried in place; the server answers /health, so it stays in the fleet and the
    request is sent again, until it has failed MAX_SENDS times: then the run stops with the error."""
    from opd_sao.engines.fleet import MAX_SENDS, Fleet

    engine = Fleet(server, max_inflight=1, timeout=0.3)
    with pytest.raises(RuntimeError, match=f"failed on {MAX_SENDS} sends"):
        engine.generate_all([GenerationRequest(prompt, SamplingParams(max_new_tokens=1000, ignore_eos=True))])
    stats = engine.stats[server]
    assert stats["alive"] and stats["requeued"] == MAX_SENDS - 1 and stats["revived"] == 0
    engine.close()


def engine_state(model_dir) -> dict[str, torch.Tensor]:
    from opd_sao.checkpoints import load_causal_lm

    return load_causal_lm(model_dir).state_dict()


# ------------------------------------------------------------------------------- issue 43: start-up and Unicode
@pytest.mark.parametrize("raw,named", [
    ('{"text": "12+7=\\ud800", "sampling_params": {"max_new_tokens": 2}}', "text holds a lone surrogate (U+D800)"),
    (b'{"text": "12+7=\xed\xa0\x80", "sampling_params": {"max_new_tokens": 2}}', "text holds a lone surrogate"),
    ('{"input_ids": %(p)s, "sampling_params": {"max_new_tokens": 2, "stop": ["\\udfff"]}}',
     "sampling_params.stop[0] holds a lone surrogate"),
], ids=["escaped", "raw-utf8", "stop"])
def test_a_lone_surrogate_is_a_400_naming_the_field(server, prompt, raw, named):
    """Before: 500 (UnicodeEncodeError in the tokenizer). A surrogate pair (an escaped emoji) is still text."""
    body = raw if isinstance(raw, bytes) else (raw % {"p": json.dumps(prompt)}).encode()
    bad = requests.post(server + "/generate", data=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert bad.status_code == 400 and named in bad.json()["error"]["message"], bad.text
    pair = requests.post(server + "/generate", data='{"text": "12+7=\\ud83d\\ude00", "sampling_params": '
                                                    '{"max_new_tokens": 2, "ignore_eos": true}}', timeout=30,
                         headers={"Content-Type": "application/json"})
    assert pair.status_code == 200 and len(pair.json()["output_ids"]) == 2, pair.text
    _assert_still_serving(server, prompt)


def test_a_model_file_linked_outside_the_weights_root_is_refused(tiny_model_dir, start_server, tmp_path):
    """Before: only the directory was resolved, so a directory under --weights-root whose model.safetensors links
    outside it was loaded (200)."""
    root = tmp_path / "root"
    shutil.copytree(tiny_model_dir, root / "m")
    (root / "m" / "model.safetensors").unlink()
    (root / "m" / "model.safetensors").symlink_to(Path(tiny_model_dir) / "model.safetensors")
    shutil.copytree(tiny_model_dir, root / "real")
    url, proc = start_server(tiny_model_dir, "--weights-root", root)
    try:
        wait_until_healthy(url, lambda: proc.poll() is None)
        linked = requests.post(url + "/update_weights_from_disk", json={"model_path": str(root / "m")}, timeout=60)
        assert linked.status_code == 400 and "model.safetensors" in linked.json()["message"], linked.text
        assert "--weights-root" in linked.json()["message"]
        inside = requests.post(url + "/update_weights_from_disk", json={"model_path": str(root / "real")}, timeout=60)
        assert inside.status_code == 200 and inside.json()["success"], inside.text
    finally:
        proc.kill()
        proc.wait()


def _serve_fails(*args: str, timeout: float = HANG_S) -> str:
    """`opd-sao serve ARGS` must exit non-zero with one `opd-sao serve: error:` line and no traceback: that line."""
    done = subprocess.run([sys.executable, "-m", "opd_sao.app.cli", "serve", *args, "--threads", "1"],
                          capture_output=True, text=True, timeout=timeout)
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1 and lines[0].startswith("opd-sao serve: error:"), done
    return lines[0]


@pytest.mark.parametrize("case", ["missing checkpoint", "--max-new-tokens 0", "missing --weights-root",
                                  "--max-batch 0", "port in use"])
def test_serve_start_up_errors_are_one_line_and_exit_non_zero(tiny_model_dir, tmp_path, case):
    """Before: a traceback (the first three); a healthy server on which every /generate waited for good
    (--max-batch 0: this test timed out); an error logged by uvicorn, then exit status 0 (port in use)."""
    model, port = str(tiny_model_dir), str(free_port())
    if case == "port in use":
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            line = _serve_fails(model, "--port", str(taken.getsockname()[1]))
        assert "cannot listen on 127.0.0.1" in line and "in use" in line
        return
    args = {"missing checkpoint": [str(tmp_path / "nothing"), "--port", port],
            "--max-new-tokens 0": [model, "--port", port, "--max-new-tokens", "0"],
            "missing --weights-root": [model, "--port", port, "--weights-root", str(tmp_path / "nothing")],
            "--max-batch 0": [model, "--port", port, "--max-batch", "0"]}[case]
    line = _serve_fails(*args)
    assert {"missing checkpoint": "nothing", "--max-new-tokens 0": "--max-new-tokens must be at least 1",
            "missing --weights-root": "--weights-root", "--max-batch 0": "--max-batch must be at least 1"}[case] in line
