"""Shared fixtures: a real tiny transformers model and tokenizer, built once per test session."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import launchers
import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")
torch.set_num_threads(1)  # tiny models: one thread is fastest, and the rollout and trainer threads get a core each


def pytest_addoption(parser):
    parser.addoption("--train-seeds", type=int, default=0, metavar="N",
                     help="run every test that takes the `train_seed` fixture once per training seed 0..N-1: the "
                          "margin sweep of docs/reliability.md (another seed moves a trained model as much as "
                          "another machine's floating point does)")


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def pytest_configure(config):
    """SIGTERM (`kill`, a CI runner's cancel) ends the session as Ctrl-C does: the fixtures' teardowns run and stop
    the servers and workers they started. Python's default for SIGTERM ends the process at once, which left them
    running, holding their ports and cores."""
    signal.signal(signal.SIGTERM, _interrupt)


def pytest_generate_tests(metafunc):
    seeds = metafunc.config.getoption("train_seeds")
    if seeds and "train_seed" in metafunc.fixturenames:
        metafunc.parametrize("train_seed", range(seeds), ids=lambda s: f"seed{s}")


@pytest.fixture
def train_seed() -> int:
    """The seed of a model-training test's margin-bearing part: 0, or each of 0..N-1 under --train-seeds N."""
    return 0


def build_tiny(out):
    """The session's tiny model (also built by scripts/seed_pass_rate.py): 2 layers, 32 wide, every domain's text."""
    from opd_sao.checkpoints import build_tiny_model
    from opd_sao.config import TinyModelConfig
    from opd_sao.envs import ENVIRONMENTS

    texts = []
    for name in ENVIRONMENTS.names():
        texts.extend(ENVIRONMENTS.get(name)().corpus(300))
    shape = TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1)
    return build_tiny_model(out, texts, shape, seed=0)


def build_perturbed_teacher(tiny, out):
    """A real OPD teacher that disagrees with the student: the tiny model with every weight perturbed."""
    from opd_sao.checkpoints import load_causal_lm, load_tokenizer, save_checkpoint

    torch.manual_seed(1)
    model = load_causal_lm(tiny)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return save_checkpoint(model, load_tokenizer(tiny), out)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def perturbed_teacher(tiny_model_dir, tmp_path_factory):
    return build_perturbed_teacher(tiny_model_dir, tmp_path_factory.mktemp("teacher") / "ckpt")


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from opd_sao.checkpoints import load_tokenizer

    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="session")
def free_port():
    """free_port() -> a loopback port nothing listens on (yet)."""
    return launchers.free_port


@pytest.fixture(scope="module")
def start_server(tmp_path_factory):
    """start_server(checkpoint, *cli_args, port=None) -> (url, process): a real `opd-sao serve` on loopback,
    one torch thread, not yet healthy (see launchers.wait_until_healthy); its output goes to a log file in
    the session's temporary directory (a pipe nobody reads would block it). Killed at the end of the test file
    that started it (module scope, so a file's shared server fixtures can use it; at the session's end, before,
    every served test file's servers stayed up, idle, for the rest of the run: ~30 processes, 5 GB)."""
    processes, logs = [], tmp_path_factory.mktemp("serve-logs")

    def start(checkpoint, *args, port=None):
        port = port or launchers.free_port()
        cmd = [sys.executable, "-m", "opd_sao.app.cli", "serve", str(checkpoint), "--port", str(port), "--threads", "1",
               *map(str, args)]
        with open(logs / f"serve-{port}.log", "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        processes.append(proc)
        return f"http://127.0.0.1:{port}", proc

    yield start
    for proc in processes:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def corpus():
    """The tiny models' tokenizer corpus: a little of every domain's text."""
    from opd_sao.envs import ENVIRONMENTS

    return [text for name in ENVIRONMENTS.names() for text in ENVIRONMENTS.get(name)().corpus(300)]


@pytest.fixture(scope="session")
def qwen_model_dir(tmp_path_factory):
    """Qwen2 architecture with the real Qwen2.5 tokenizer: no BOS, eos ids [151645, 151643], vocab 151,936."""
    from real_models import build_qwen2

    return build_qwen2(tmp_path_factory.mktemp("real_models") / "qwen2")


@pytest.fixture(scope="session")
def llama_model_dir(tmp_path_factory, corpus):
    """Llama architecture, untied embeddings, the project's tokenizer (with BOS), padded vocabulary."""
    from real_models import build_llama

    return build_llama(tmp_path_factory.mktemp("real_models") / "llama", corpus)


WINDOWS = {"mistral": {"sliding_window": 4},  # every layer windowed
           "gemma3": {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
           "llama4": {"attention_chunk_size": 4, "num_local_experts": 2, "intermediate_size_mlp": 64}}  # chunks, MoE


@pytest.fixture(scope="session", params=list(WINDOWS))
def windowed_model_dir(request, tmp_path_factory, corpus):
    """Attention limited to 4 positions, narrower than the tests' rows: Mistral's sliding window on every layer,
    Gemma 3's on one of its two, Llama 4's attention chunks; the project's tokenizer."""
    from real_models import build_small

    return build_small(tmp_path_factory.mktemp("windowed") / request.param, corpus, request.param,
                       config=WINDOWS[request.param])
