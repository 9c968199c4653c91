"""The consistency gate in a ZeRO-3 stage, on 2 gloo ranks (this file is also the worker script).

Under ZeRO-3 no rank holds the whole policy; the gate scores the probe with the backend's own batched forward,
which every rank joins, and a failure's diagnosis reads a copy gathered from every rank's partition. Checked: the
gate passes on an engine holding the trainer's weights, and after one training step it catches an engine that
claims the new version with the old weights (stale weights: version_skew, from the gathered copy's weights).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worker(args: dict) -> None:
    """Rank 0: a ZeRO-3 trainer, an embedded engine on the same checkpoint and a gate; the other rank follows."""
    from opd_sao.checkpoints import load_causal_lm, load_tokenizer
    from opd_sao.config import GateConfig, RolloutConfig, TrainerConfig
    from opd_sao.consistency.gate import ConsistencyGate, GateFailure, probe_episodes
    from opd_sao.engines.embedded import EmbeddedEngine
    from opd_sao.envs import ENVIRONMENTS
    from opd_sao.trainers.deepspeed_backend import DeepSpeedTrainer, follow, init_distributed
    from opd_sao.trajectory import Trajectory, collate

    init_distributed()
    if int(os.environ["RANK"]) != 0:
        follow()
        return
    out, model = Path(args["out"]), args["model"]
    tokenizer = load_tokenizer(model)
    cfg = TrainerConfig(policy_lr=1e-2, backend="deepspeed", deepspeed_config={"zero_optimization": {"stage": 3}})
    trainer = DeepSpeedTrainer(model, cfg, with_critic=False, attn_implementation="sdpa")
    engine = EmbeddedEngine(load_causal_lm(model, attn_implementation="sdpa"), eos_id=tokenizer.eos_token_id,
                            pad_id=tokenizer.pad_token_id)
    probe = lambda: probe_episodes(ENVIRONMENTS.get("arithmetic"), tokenizer,
                                   RolloutConfig(max_new_tokens=6), domain="arithmetic", n=4, seed=0)
    gate = ConsistencyGate(GateConfig(), stage="zero3", out_dir=out, engine=engine, backend=trainer,
                           make_probe=probe, eps_low=0.3, eps_high=5.0, pad_id=tokenizer.pad_token_id)
    gate.run("start")
    old = trainer.policy_state_dict()
    traj = Trajectory("t", "arithmetic", [tokenizer.bos_token_id, 7, 8], [9, 10, 11], [1, 1, 1], [0.0] * 3, [0] * 3,
                      rewards=[0.0] * 3)
    batch = collate([traj], tokenizer.pad_token_id)
    logp = trainer.policy_logprobs(batch, 1.0, grad=True)
    trainer.step_policy(-(logp * batch.action_mask).sum())
    engine.update_weights(old, trainer.policy_version)  # claims version 1, keeps version 0's weights
    try:
        gate.run("step", step=1)
        failure = None
    except GateFailure as err:
        failure = str(err)
    (out / "result.json").write_text(json.dumps({"failure": failure}))


def test_the_gate_runs_and_diagnoses_in_a_zero3_stage(tmp_path, perturbed_teacher, free_port):
    env = {**os.environ, "DS_BUILD_OPS": "0", "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "",  # gloo on CPU
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / "build" / "torch_extensions"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           __file__, json.dumps({"out": str(tmp_path), "model": str(perturbed_teacher)})]
    result = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    evaluations = json.loads((tmp_path / "gate.json").read_text())["evaluations"]
    start, stale = evaluations
    print(f"\nZeRO-3 gate: start mean |diff| {start['mean_abs_diff']:.2e} over {start['tokens']} tokens; stale "
          f"weights {stale['mean_abs_diff']:.2e}, diagnosed {stale['diagnosis']['cause']}")
    assert start["passed"] and start["tokens"] > 0 and start["mode"] == "trainer"
    assert not stale["passed"] and stale["diagnosis"]["cause"] == "version_skew"
    assert stale["diagnosis"]["evidence"]["weight_max_abs_diff"] > 1e-3  # read from the gathered copy
    assert "version_skew" in json.loads((tmp_path / "result.json").read_text())["failure"]


if __name__ == "__main__":
    worker(json.loads(sys.argv[-1]))
    from opd_sao.trainers.deepspeed_backend import shut_down

    shut_down(0)
