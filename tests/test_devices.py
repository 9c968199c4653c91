"""Device placement: the config's `device` reaches every component, and a device this machine lacks is refused.

This machine has no GPU. Two kinds of tests stand in for one:
- run with `device: cpu` and check where every component put its models and outputs;
- pretend CUDA is there (torch.cuda.is_available / device_count patched, nothing of ours is) and ask each
  component for `cuda`: a CPU-only torch then raises the moment a component moves a model or a tensor to
  the GPU, which proves it goes where it is told (a component ignoring the setting would build fine on CPU).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launchers import HANG_S, free_port

from opd_sao.config import (
    AlgoConfig,
    ConfigError,
    EngineConfig,
    EvalConfig,
    RolloutConfig,
    SFTConfig,
    TrainerConfig,
    parse_config,
)
from opd_sao.devices import resolve_device

ROOT = Path(__file__).resolve().parents[1]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what happens on a machine without CUDA")
ON_GPU = r"Torch not compiled with CUDA enabled|Cannot get CUDA generator"  # what CPU-only torch says at .to("cuda")


def _config(**top):
    return {"logging": {"wandb": False, "progress": False}, **top,
            "stages": [{"name": "reasoning", "kind": "reasoning", "env": "arithmetic", "steps": 1}]}


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    expected = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("auto") == resolve_device(None) == expected
    with pytest.raises(ValueError, match="not one of auto, cpu, cuda, cuda:N"):
        resolve_device("gpu")


def test_device_defaults_and_overrides_in_the_config():
    cfg = parse_config(_config())
    assert cfg.device == "auto" and cfg.engine_device == "auto" and cfg.stage_trainer(cfg.stages[0]).device == "auto"
    cfg = parse_config(_config(device="cpu"), ["engine.device=cpu", "stages.reasoning.trainer.device=cpu"])
    assert cfg.engine_device == "cpu" and cfg.stage_trainer(cfg.stages[0]).device == "cpu"
    with pytest.raises(ConfigError, match="^device: String should match pattern"):
        parse_config(_config(device="gpu"))


@NO_CUDA
@pytest.mark.parametrize("override", ["device=cuda", "device=cuda:1", "engine.device=cuda", "trainer.device=cuda:0",
                                      "stages.reasoning.trainer.device=cuda"])
def test_cuda_without_cuda_is_refused_in_one_line(override):
    with pytest.raises(ConfigError, match="no CUDA device on this machine") as err:
        parse_config(_config(), [override])
    assert "\n" not in str(err.value)


@NO_CUDA
@pytest.mark.parametrize("args", [["run", "configs/reasoning.yaml", "device=cuda"],
                                  ["serve", "CKPT", "--port", "PORT", "--device", "cuda"],
                                  ["audit", "CKPT", "--device", "cuda:0", "--out", "OUT"],
                                  ["reward-model", "OUT", "--device", "cuda"]])
def test_the_cli_refuses_cuda_before_any_work(tmp_path, tiny_model_dir, args):
    args = [{"CKPT": str(tiny_model_dir), "OUT": str(tmp_path / "out"), "PORT": str(free_port())}.get(a, a)
            for a in args]
    extra = ["--run-dir", str(tmp_path / "run")] if args[0] == "run" else []
    result = subprocess.run([sys.executable, "-m", "opd_sao.app.cli", *args, *extra], cwd=ROOT, capture_output=True,
                            text=True, timeout=HANG_S)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "no CUDA device" in result.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "out").exists()  # nothing was started


def test_components_run_on_the_configured_device(tiny_model_dir, tokenizer):
    """device: cpu, given explicitly to every component: models, outputs and the learner's batch all on it."""
    from opd_sao.consistency.check import check
    from opd_sao.engines import build_engine
    from opd_sao.engines.base import GenerationRequest, SamplingParams
    from opd_sao.rl.learner import Learner
    from opd_sao.trainers import TorchTrainer
    from opd_sao.trajectory import Trajectory, collate

    cpu = torch.device("cpu")
    backend = TorchTrainer(tiny_model_dir, TrainerConfig(device="cpu", critic_warmup_steps=0), with_critic=True)
    assert backend.device == cpu
    assert {p.device for m in (backend.policy, backend.critic) for p in m.parameters()} == {cpu}
    engine = build_engine(EngineConfig(), tiny_model_dir, tokenizer, seed=0, device="cpu")
    assert engine.device == cpu and {p.device for p in engine.model.parameters()} == {cpu}
    prompt = [tokenizer.bos_token_id] + tokenizer.encode("12+3=", add_special_tokens=False)
    results = engine.generate_all([GenerationRequest(prompt, SamplingParams(max_new_tokens=4)) for _ in range(4)])
    trajs = []
    for i, res in enumerate(results):
        traj = Trajectory(f"t{i}", "arithmetic", prompt)
        traj.append(res.token_ids, action=True, logp=res.logprobs, versions=res.versions)
        traj.add_reward(float(i % 2))
        trajs.append(traj)
    batch = collate(trajs, tokenizer.pad_token_id).to(backend.device)
    assert batch.input_ids.device == cpu and batch.rewards.device == cpu
    assert backend.policy_logprobs(batch, 1.0, grad=False).device == cpu
    assert backend.critic_values(batch, grad=False).device == cpu
    metrics = Learner(backend, "sao", AlgoConfig(), critic_steps=1, critic_warmup_steps=0).step(batch, 1.0)
    assert backend.policy_version == 1 and metrics["policy_loss"] == metrics["policy_loss"]  # a finite step
    engine.update_weights(backend.policy_state_dict(), backend.policy_version)
    assert {p.device for p in engine.model.parameters()} == {cpu}
    report = check(trajs, backend.policy_model, version=0)
    assert report.tokens == sum(t.num_action_tokens for t in trajs)


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch says a GPU is there; CPU-only torch still fails the moment anything is put on it."""
    if torch.cuda.is_available():
        pytest.skip("a real GPU: scripts/gpu_check.sh covers it")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("auto") == torch.device("cuda")


def _trainer(path, tok, tmp, device="cuda"):
    from opd_sao.trainers import TorchTrainer

    TorchTrainer(path, TrainerConfig(device=device), with_critic=True)


def _engine(path, tok, tmp, engine_device="cuda", run_device="cpu"):
    from opd_sao.engines import build_engine

    build_engine(EngineConfig(device=engine_device), path, tok, seed=0, device=run_device)


def _teacher(path, tok, tmp):
    from opd_sao.teachers import InProcessTeacher, TeacherSpec
    from opd_sao.teachers.routing import model_vocab_size

    spec = TeacherSpec(name="t", kind="in_process", checkpoint=path, domains=("d",), granularity="sampled", k=None,
                       p=None, checkpoint_hash="h", vocab_size=model_vocab_size(path), tokenizer_hash="t",
                       device="cuda")
    InProcessTeacher(spec).load(path)


def _sft(path, tok, tmp):
    from opd_sao.supervised import run_sft

    run_sft(path, tmp / "out", [([1, 5], [6, 2])], tok, SFTConfig(steps=1, batch_size=1), 0,
            trainer=TrainerConfig(device="cuda"))


def _evaluate(path, tok, tmp):
    from opd_sao.envs import ENVIRONMENTS
    from opd_sao.runs.evaluation import evaluate

    evaluate(path, ENVIRONMENTS.get("arithmetic"), tok, domain="arithmetic", rollout=RolloutConfig(),
             eval_cfg=EvalConfig(num_tasks=1), seed=0, device="cuda")


def _serve(path, tok, tmp):
    from opd_sao.engines.server import RolloutServer

    RolloutServer(path, device="cuda")


def _reward_model(path, tok, tmp):
    from opd_sao.envs.dataset.rewards import RewardModelReward

    RewardModelReward(str(path), device="cuda")


COMPONENTS = {
    "torch trainer": _trainer,
    "torch trainer, auto": lambda path, tok, tmp: _trainer(path, tok, tmp, device=None),
    "engine.device": _engine,
    "engine, the run's device": lambda path, tok, tmp: _engine(path, tok, tmp, engine_device=None, run_device="cuda"),
    "teacher": _teacher,
    "sft": _sft,
    "evaluation": _evaluate,
    "serve": _serve,
    "reward model": _reward_model,
}


@pytest.mark.parametrize("component", list(COMPONENTS))
def test_every_component_goes_to_the_device_it_is_given(fake_cuda, tiny_model_dir, tokenizer, tmp_path, component):
    with pytest.raises((AssertionError, RuntimeError), match=ON_GPU):
        COMPONENTS[component](tiny_model_dir, tokenizer, tmp_path)


def test_the_engine_samples_with_a_generator_on_its_device(fake_cuda, tiny_model_dir, tokenizer):
    """The engine's batches and sampling generator follow its model (here: a CPU model, under a CUDA-capable torch)."""
    from opd_sao.engines import build_engine

    engine = build_engine(EngineConfig(device="cpu"), tiny_model_dir, tokenizer, seed=0)
    assert engine.device == torch.device("cpu") and engine.generator.device == torch.device("cpu")


HAS_NVIDIA_GPU = subprocess.run("command -v nvidia-smi && nvidia-smi -L", shell=True, capture_output=True).returncode == 0


@pytest.mark.skipif(HAS_NVIDIA_GPU, reason="this machine has an NVIDIA GPU: the script would run the check")
def test_gpu_check_exits_2_with_one_line_without_a_gpu(tmp_path):
    out = tmp_path / "gpu_check.txt"
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out)], capture_output=True, text=True,
                            timeout=HANG_S)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == ["gpu_check: no NVIDIA GPU on this machine (nvidia-smi is missing or lists "
                                          "no device); nothing to check"]
    assert not out.exists()


def test_the_gpu_check_config_is_valid_for_every_run_setting():
    """configs/gpu_check.yaml with each run's overrides from scripts/gpu_check.sh (device=cpu here: no GPU)."""
    import re

    import yaml

    from opd_sao.app.pipeline import check_before_work

    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    stages = re.search(r'^STAGES="([^"]+)"', script, re.M).group(1).split()
    gate = [f"stages.{s}.gate.{k}" for s in stages for k in ("mean_abs_diff=2e-2", "p99_abs_diff=2e-1")]
    runs = {name: body.replace('"$gate', "").replace('$gate"', "").replace('"', "").replace("\\", "").split()
            for name, body in re.findall(r"^\s+([a-z0-9-]+)\) echo (.+?) ;;$", script, re.M | re.S)}
    assert set(runs) == {"torch-fp32", "torch-bf16", "deepspeed-bf16"}
    data = yaml.safe_load((ROOT / "configs" / "gpu_check.yaml").read_text())
    assert [s["kind"] for s in data["stages"]] == ["sft", "reasoning", "agent", "chat", "opd"]
    for name, overrides in runs.items():
        overrides = ["device=cpu" if o == "device=cuda" else o for o in overrides]
        if "bf16" in name:
            overrides += gate
        cfg = parse_config(yaml.safe_load((ROOT / "configs" / "gpu_check.yaml").read_text()), overrides)
        check_before_work(cfg)  # each override names a section its stage's kind reads
        assert cfg.device == "cpu" and cfg.trainer.backend == name.split("-")[0]
        assert cfg.trainer.dtype == ("bfloat16" if "bf16" in name else "float32") == cfg.engine.dtype
        if "bf16" in name:
            assert {s.gate.mean_abs_diff for s in cfg.stages if s.kind != "sft"} == {2e-2}


def test_bfloat16_trains_in_mixed_precision(tiny_model_dir, tokenizer, tmp_path):
    """trainer.dtype bfloat16 computes in bfloat16 and keeps float32 weights and AdamW state: a step of lr 1e-6
    moves every trained weight (on bfloat16 weights, 8 mantissa bits, such an update is rounded away), and the
    logprobs, values and SFT loss differ from float32's by bfloat16 rounding, not by nothing."""
    from opd_sao.algorithms import sft_loss
    from opd_sao.model.modeling import sequence_logprobs
    from opd_sao.supervised import run_sft
    from opd_sao.trainers import TorchTrainer
    from opd_sao.trajectory import Trajectory, collate

    prompt = [tokenizer.bos_token_id] + tokenizer.encode("12+3=", add_special_tokens=False)
    traj = Trajectory("t", "arithmetic", prompt)
    answer = tokenizer.encode("15", add_special_tokens=False) + [tokenizer.eos_token_id]
    traj.append(answer, action=True, logp=[-1.0] * len(answer), versions=[0] * len(answer))
    batch = collate([traj], tokenizer.pad_token_id)
    fp32 = TorchTrainer(tiny_model_dir, TrainerConfig(device="cpu"), with_critic=True)
    bf16 = TorchTrainer(tiny_model_dir, TrainerConfig(device="cpu", dtype="bfloat16", policy_lr=1e-6,
                                                      critic_lr=1e-6), with_critic=True)
    assert {p.dtype for m in (bf16.policy, bf16.critic) for p in m.parameters()} == {torch.float32}
    head = torch.randn_like(fp32.critic.value_head.weight)  # a fresh critic's head is 0: values would agree at 0
    for trainer in (fp32, bf16):
        trainer.critic.value_head.weight.data.copy_(head)
    act = batch.action_mask.bool()
    support = torch.arange(5).expand(int(act.sum()), -1)  # OPD's support log-probs: the same compute precision
    fp32_support, bf16_support = (t.policy_support_logprobs(batch, support, torch.ones_like(support, dtype=torch.bool),
                                                            vocab_chunk=64, top_k=0)[0] for t in (fp32, bf16))
    assert 1e-5 < float((bf16_support - fp32_support).detach().abs().max()) < 0.1
    for name in ("policy", "critic"):
        get = (lambda b, g: b.policy_logprobs(batch, 1.0, grad=g)) if name == "policy" else \
            (lambda b, g: b.critic_values(batch, grad=g))
        gap = (get(bf16, False) - get(fp32, False))[act].abs().max()
        assert 1e-5 < gap < 0.1, f"{name}: bfloat16 compute should differ from float32 by rounding, got {gap}"
        before = {n: p.detach().clone() for n, p in getattr(bf16, name).named_parameters() if p.requires_grad}
        out = get(bf16, True)
        loss = -(out[act]).mean() if name == "policy" else (out[act] - 1).pow(2).mean()
        (bf16.step_policy if name == "policy" else bf16.step_critic)(loss)
        moved = {n: float((p.detach() - before[n]).abs().max()) for n, p in getattr(bf16, name).named_parameters()
                 if p.requires_grad and p.grad is not None and p.grad.abs().max() > 0}
        assert moved and all(0 < m < 1e-5 for m in moved.values()), f"{name}: {moved}"

    checkpoint = run_sft(tiny_model_dir, tmp_path / "sft", [(prompt, traj.token_ids)], tokenizer,
                         SFTConfig(steps=1, batch_size=1, lr=1e-6), 0,
                         trainer=TrainerConfig(device="cpu", dtype="bfloat16"))
    from opd_sao.checkpoints import load_causal_lm
    trained, start = load_causal_lm(checkpoint), load_causal_lm(tiny_model_dir)
    assert {p.dtype for p in trained.parameters()} == {torch.float32}
    assert any(0 < float((a - b).detach().abs().max()) < 1e-5 for a, b in zip(trained.parameters(), start.parameters()))
    ids, mask = batch.input_ids, batch.attention_mask
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp = sequence_logprobs(start, ids, mask, only=batch.action_mask)
        assert sft_loss(logp, batch.action_mask).dtype == torch.float32  # logprobs accumulate in fp32
