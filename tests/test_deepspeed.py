"""DeepSpeed backend: 2 CPU processes (gloo) train SAO steps and match the single-process torch backend.

One fixed batch of real rollouts; the torch backend trains on it in this process, the DeepSpeed backend
in 2 processes under torchrun (this file is also the worker script). Rank 0 runs the Learner on the
whole batch; each rank computes the forward and backward of half the rows.

Tolerance: 1e-5 relative on per-step losses, gradient norms and ratios, 1e-5 absolute on the policy
weights (lr 1e-3: one Adam step moves a weight by about 1e-3). Row-split forwards and the gradient
all-reduce change float32 rounding only; measured: 3e-7 relative, 4e-7 absolute (the test prints them).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launchers import free_port

REPO = Path(__file__).resolve().parents[1]
STEPS, SAVE_AFTER, ZERO3_STEPS = 5, 3, 2
LOSS_RTOL, WEIGHT_ATOL = 1e-5, 1e-5


def _trainer_cfg(**kw):
    from opd_sao.config import TrainerConfig

    # a cosine lr schedule: DeepSpeed steps it as torch does, and a resumed run must restore it
    return TrainerConfig(policy_lr=1e-3, critic_lr=1e-3, critic_steps=2, critic_warmup_steps=0, lr_schedule="cosine",
                         warmup_steps=1, min_lr_ratio=0.1, **kw)


def _learner(backend, minibatches: bool = True):
    from opd_sao.config import AlgoConfig
    from opd_sao.rl.learner import Learner

    # minibatches: the critic's two updates each on half of the 10 trajectories, split 3 / 2 between the ranks
    # (uneven shares: the collective forwards' harder case); else two passes over the whole batch (the default)
    return Learner(backend, "sao", AlgoConfig(), critic_steps=2, critic_warmup_steps=0,
                   critic_minibatches=minibatches)


def _load_batch(path: Path, pad_id: int):
    from opd_sao.trajectory import Trajectory, collate

    return collate([Trajectory.from_json(line) for line in path.read_text().splitlines()], pad_id)


def _train(learner, batch, steps: int) -> list[dict]:
    keys = ("policy_loss", "value_loss", "policy_grad_norm", "critic_grad_norm", "mask_fraction", "ratio_min",
            "ratio_max")
    return [{k: v for k, v in learner.step(batch, 1.0).items() if k in keys} for _ in range(steps)]


def worker(args: dict) -> None:
    """Rank 0: ZeRO-2 steps (critic mini-batches), save, continue; reload and continue; export; ZeRO-3 steps (the
    K-pass critic). Others follow."""
    from opd_sao.checkpoints import load_causal_lm
    from opd_sao.trainers.deepspeed_backend import (
        DeepSpeedTrainer,
        follow,
        init_distributed,
    )

    init_distributed()
    if int(os.environ["RANK"]) != 0:
        follow()
        return
    out, model = Path(args["out"]), args["model"]
    batch = _load_batch(Path(args["batch"]), args["pad_id"])
    if args.get("only_zero3"):
        _zero3_steps(model, batch, out)
        return
    zero2 = _trainer_cfg(backend="deepspeed", deepspeed_config={"zero_optimization": {"stage": 2}})
    backend = DeepSpeedTrainer(model, zero2, total_steps=STEPS)
    learner = _learner(backend)
    history = _train(learner, batch, SAVE_AFTER)
    backend.save_state(out / "state")
    history += _train(learner, batch, STEPS - SAVE_AFTER)
    continued = backend.policy_state_dict()

    resumed_backend = DeepSpeedTrainer(model, zero2, total_steps=STEPS)
    resumed_backend.load_state(out / "state")
    resumed_version = resumed_backend.policy_version
    _train(_learner(resumed_backend), batch, STEPS - SAVE_AFTER)
    resumed = resumed_backend.policy_state_dict()
    from opd_sao.checkpoints import load_tokenizer

    exported = load_causal_lm(resumed_backend.export_policy(out / "export", load_tokenizer(model))).state_dict()

    torch.save({"history": history, "continued": continued, "resumed": resumed, "resumed_version": resumed_version,
                "exported": exported}, out / "results.pt")
    _zero3_steps(model, batch, out)


def _zero3_steps(model: str, batch, out: Path) -> None:
    """ZeRO-3 steps of the K-pass critic (rank 0; the others follow)."""
    from opd_sao.trainers.deepspeed_backend import DeepSpeedTrainer

    zero3 = _trainer_cfg(backend="deepspeed", deepspeed_config={"zero_optimization": {"stage": 3}})
    z3_backend = DeepSpeedTrainer(model, zero3, total_steps=STEPS)
    z3_history = _train(_learner(z3_backend, minibatches=False), batch, ZERO3_STEPS)  # the K-pass critic
    torch.save({"z3_history": z3_history, "z3_weights": z3_backend.policy_state_dict(), "world": z3_backend.world},
               out / "zero3.pt")


@pytest.fixture(scope="module")
def fixed_batch(tmp_path_factory, tiny_model_dir, tokenizer):
    """Real rollouts of the tiny model with varied positive rewards.

    Rewards that sum to about zero would leave the value head's bias with a gradient of rounding noise,
    and Adam's first step (lr * g / |g|) turns noise into a full-size update: not a backend difference.
    """
    from opd_sao.checkpoints import load_causal_lm
    from opd_sao.engines import EmbeddedEngine
    from opd_sao.engines.base import SamplingParams
    from opd_sao.envs import ENVIRONMENTS
    from opd_sao.rl.rollout import Episode, run_episodes

    env_cls = ENVIRONMENTS.get("arithmetic")
    tasks = env_cls().make_tasks("train", 10, seed=0)
    engine = EmbeddedEngine(load_causal_lm(tiny_model_dir), eos_id=tokenizer.eos_token_id,
                            pad_id=tokenizer.pad_token_id, max_batch=16, seed=0)
    episodes = [Episode(env_cls(), task, tokenizer, SamplingParams(max_new_tokens=3 + i % 6), domain="arithmetic",
                        max_turns=1, max_context_tokens=64, traj_id=f"t{i}") for i, task in enumerate(tasks)]
    trajs = run_episodes(engine, episodes)
    for i, traj in enumerate(trajs):
        traj.add_reward(0.25 * (i % 4) + 0.1)
    path = tmp_path_factory.mktemp("ds") / "batch.jsonl"
    path.write_text("\n".join(t.to_json() for t in trajs) + "\n")
    return path


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _assert_histories_match(ours: list[dict], ref: list[dict]) -> float:
    worst = 0.0
    for step, (o, r) in enumerate(zip(ours, ref)):
        assert o.keys() == r.keys()
        for key in r:
            rel = abs(o[key] - r[key]) / max(abs(r[key]), 1e-6)
            worst = max(worst, rel)
            assert rel < LOSS_RTOL, f"step {step} {key}: deepspeed {o[key]} vs torch {r[key]}"
    return worst


def _launch(args: dict) -> subprocess.Popen:
    """This file's worker on 2 gloo ranks under torchrun."""
    env = {**os.environ, "DS_BUILD_OPS": "0", "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "",  # gloo on CPU
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / "build" / "torch_extensions"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           __file__, json.dumps(args)]
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_two_process_zero2_matches_torch_backend_and_resumes(tmp_path, fixed_batch, tiny_model_dir, tokenizer):
    from opd_sao.trainers import TorchTrainer

    proc = _launch({"out": str(tmp_path), "model": str(tiny_model_dir), "batch": str(fixed_batch),
                    "pad_id": tokenizer.pad_token_id})
    # the reference trains while the workers start
    reference = TorchTrainer(tiny_model_dir, _trainer_cfg(), total_steps=STEPS)
    ref_learner = _learner(reference)
    ref_history = _train(ref_learner, _load_batch(fixed_batch, tokenizer.pad_token_id), STEPS)
    ref_final = reference.policy_state_dict()
    k_pass = TorchTrainer(tiny_model_dir, _trainer_cfg(), total_steps=STEPS)  # ZeRO-3's reference
    k_pass_history = _train(_learner(k_pass, minibatches=False), _load_batch(fixed_batch, tokenizer.pad_token_id),
                            ZERO3_STEPS)
    ref_after_z3 = k_pass.policy_state_dict()
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-4000:]
    res = {**torch.load(tmp_path / "results.pt", weights_only=False),
           **torch.load(tmp_path / "zero3.pt", weights_only=False)}

    assert res["world"] == 2
    loss_rel = _assert_histories_match(res["history"], ref_history)
    weight_diff = _max_diff(res["continued"], ref_final)
    z3_rel = _assert_histories_match(res["z3_history"], k_pass_history)
    z3_diff = _max_diff(res["z3_weights"], ref_after_z3)
    print(f"\nZeRO-2 vs torch: loss rel {loss_rel:.2e}, weights {weight_diff:.2e}; "
          f"ZeRO-3: loss rel {z3_rel:.2e}, weights {z3_diff:.2e}")
    assert weight_diff < WEIGHT_ATOL and z3_diff < WEIGHT_ATOL
    # checkpoint, reload, continue: the same weights as never stopping
    assert res["resumed_version"] == SAVE_AFTER
    assert _max_diff(res["resumed"], res["continued"]) < 1e-7
    assert _max_diff(res["exported"], res["resumed"]) == 0



@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory, tiny_model_dir, tokenizer):
    """A Mixtral (4 experts, 2 per token, fused expert weights) on the tiny model's tokenizer: the paper's critic
    is an MoE model's, training expert projections with attention and routers frozen."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from opd_sao.checkpoints import MODEL_INIT_LOCK, load_causal_lm, save_checkpoint

    vocab = load_causal_lm(tiny_model_dir).config.vocab_size
    config = MixtralConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
                           bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with MODEL_INIT_LOCK:
        model = MixtralForCausalLM(config)
    return save_checkpoint(model, tokenizer, tmp_path_factory.mktemp("moe") / "mixtral")


def test_zero3_moe_critic_matches_torch_backend(tmp_path, fixed_batch, moe_model_dir, tokenizer):
    """ZeRO-3 partitions every expert across the 2 ranks, and each rank routes its rows to its own experts: the
    K-pass critic (experts train, routers and attention frozen) and the policy match the torch backend's steps."""
    from opd_sao.trainers import TorchTrainer

    proc = _launch({"out": str(tmp_path), "model": str(moe_model_dir), "batch": str(fixed_batch),
                    "pad_id": tokenizer.pad_token_id, "only_zero3": True})
    reference = TorchTrainer(moe_model_dir, _trainer_cfg(), total_steps=STEPS)
    ref_history = _train(_learner(reference, minibatches=False), _load_batch(fixed_batch, tokenizer.pad_token_id),
                         ZERO3_STEPS)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-4000:]
    res = torch.load(tmp_path / "zero3.pt", weights_only=False)
    assert res["world"] == 2 and all(step["critic_grad_norm"] > 0 for step in ref_history)
    rel = _assert_histories_match(res["z3_history"], ref_history)
    diff = _max_diff(res["z3_weights"], reference.policy_state_dict())
    print(f"\nZeRO-3 MoE vs torch: loss rel {rel:.2e}, weights {diff:.2e}")
    assert diff < WEIGHT_ATOL


if __name__ == "__main__":
    worker(json.loads(sys.argv[-1]))
    # Leave without interpreter teardown: with the results written and the process group destroyed, torch's
    # and DeepSpeed's C++ threads can still abort the exit ("terminate called without an active exception",
    # seen in 2 of 3 fresh-clone suite runs, never alone); that is not what this test measures.
    from opd_sao.trainers.deepspeed_backend import shut_down

    shut_down(0)
