"""OPD under DeepSpeed: 2 CPU processes (gloo) take the same OPD learner steps as the torch backend, at ZeRO-2 and
at ZeRO-3 (where the student's support log-probs come from the model's own forward's logits).

One fixed batch of the student's own trajectories on two domains; the teacher is a real perturbed copy of
the tiny model, scored through the real `TeacherTargets` path (teacher set, prefetcher, logit cache). The
torch backend takes the steps in this process, the DeepSpeed backend in 2 processes under torchrun (this
file is also the worker script), one learner step per setting, one after the other on the same weights:

* top_k teachers with `reward_weight` 0.5: the divergence (`policy_support_logprobs`) and the reward's
  policy gradient (`policy_logprobs`) both feed one optimizer step;
* top_p teachers (reverse KL), divergence only: the path that crashed under DeepSpeed before;
* one sampled and one full teacher: a sampled-token forward plus the whole-vocabulary support (of one
  trajectory: rank 1 has no rows);
* top_p with `reward_weight` 0.5 (JSD).

Tolerance: 1e-5 relative on losses, divergences and gradient norms, 1e-5 absolute on the weights after each
step (lr 1e-3); row-split forwards and the gradient all-reduce change float32 rounding only (the test
prints the worst differences). A second test runs `opd-sao run` with an OPD stage on 2 DeepSpeed ranks.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
DOMAINS = ["digits_reverse", "digits_sort"]
SETTINGS = [
    {"granularity": "top_k", "reward_weight": 0.5},
    {"granularity": "top_p", "divergence": "reverse_kl"},
    {"granularity": "full", "teachers": {"digits_reverse": "sampled"}},
    {"granularity": "top_p", "divergence": "jsd", "reward_weight": 0.5},
]
KEYS = ("policy_loss", "policy_grad_norm", "divergence", "kl", "support_mass")
RTOL, WEIGHT_ATOL = 1e-5, 1e-5
ZERO_STAGES = (2, 3)  # ZeRO-3's support log-probs come from the model's own forward (dense_support_logprobs)


def _learner(backend, setting: dict, student: str, teacher: str, tokenizer, work: Path):
    """An OPD learner on `backend` with one teacher per domain (the same checkpoint), scored into `work`."""
    from opd_sao.config import AlgoConfig, OPDConfig
    from opd_sao.rl.distill import OPDLearner
    from opd_sao.teachers import Prefetcher, TeacherSet, TeacherTargets

    setting = dict(setting)
    per_teacher = setting.pop("teachers", {})
    teachers = [{"name": f"t_{d}", "checkpoint": teacher, "domains": [d],
                 **({"granularity": per_teacher[d]} if d in per_teacher else {})} for d in DOMAINS]
    cfg = OPDConfig(teachers=teachers, top_k=8, top_p=0.6, vocab_chunk=100, **setting)
    reg = TeacherSet.from_config(cfg, domains=DOMAINS, resolve=Path, student_checkpoint=student,
                                 student_tokenizer=tokenizer)
    prefetcher = Prefetcher(reg.build_all(), local_dir=work / "tier", max_resident=1)
    return OPDLearner(backend, cfg, AlgoConfig(), TeacherTargets(reg, prefetcher, work / "cache")), prefetcher


def _steps(backend, batch, student: str, teacher: str, tokenizer, work: Path) -> tuple[list[dict], list[dict]]:
    """One learner step per setting on `backend`: (metrics, weights after each step)."""
    history, weights = [], []
    for i, setting in enumerate(SETTINGS):
        learner, prefetcher = _learner(backend, setting, student, teacher, tokenizer, work / f"setting{i}")
        metrics = learner.step(batch, 1.0)
        prefetcher.close()
        history.append({k: metrics[k] for k in KEYS if k in metrics})
        weights.append(backend.policy_state_dict())
    return history, weights


def _trainer_cfg(**kw):
    from opd_sao.config import TrainerConfig

    return TrainerConfig(policy_lr=1e-3, **kw)


def worker(args: dict) -> None:
    """Rank 0: the OPD steps at ZeRO-2, then again at ZeRO-3; the other rank follows."""
    from launchers import deepspeed_rank0_batch

    from opd_sao.trainers.deepspeed_backend import DeepSpeedTrainer

    rank0 = deepspeed_rank0_batch(args["student"], args["batch"])
    if rank0 is None:
        return
    tokenizer, batch = rank0
    results = {}
    for zero in ZERO_STAGES:  # each from the student's weights
        backend = DeepSpeedTrainer(args["student"], _trainer_cfg(
            backend="deepspeed", deepspeed_config={"zero_optimization": {"stage": zero}}), with_critic=False)
        history, weights = _steps(backend, batch, args["student"], args["teacher"], tokenizer,
                                  Path(args["out"]) / f"zero{zero}")
        results[zero] = {"history": history, "weights": weights, "world": backend.world}
    torch.save(results, Path(args["out"]) / "results.pt")


def _batch_file(student, tokenizer, path: Path) -> Path:
    """The student's own trajectories (its logprobs as rollout logprobs), 7 of varied length, one of them on the
    second domain: the ranks' shares hold different numbers of action rows, and a forward of that domain's
    trajectory alone leaves rank 1 without rows."""
    from opd_sao.checkpoints import load_causal_lm
    from opd_sao.model.modeling import sequence_logprobs
    from opd_sao.trajectory import Trajectory

    model, rng, lines = load_causal_lm(student), np.random.default_rng(0), []
    for i in range(7):
        domain = DOMAINS[int(i == 3)]
        prompt = [tokenizer.bos_token_id] + tokenizer.encode(f"{domain[:3]} {i}{i + 3}=", add_special_tokens=False)
        tokens = rng.integers(5, 200, size=2 + i % 4).tolist()
        seq = torch.tensor([prompt + tokens])
        with torch.no_grad():
            logp = sequence_logprobs(model, seq, torch.ones_like(seq))[0, len(prompt):].tolist()
        lines.append(Trajectory(traj_id=f"t{i}", domain=domain, prompt_ids=prompt, token_ids=tokens,
                                action_mask=[1] * len(tokens), rollout_logp=logp, versions=[0] * len(tokens),
                                rewards=[0.0] * (len(tokens) - 1) + [0.3 * (i % 3)]).to_json())
    path.write_text("\n".join(lines) + "\n")
    return path


def test_two_process_zero2_and_zero3_opd_steps_match_torch_backend(tmp_path, tiny_model_dir, perturbed_teacher,
                                                                    tokenizer, free_port):
    from opd_sao.trainers import TorchTrainer
    from opd_sao.trajectory import Trajectory, collate

    batch_file = _batch_file(tiny_model_dir, tokenizer, tmp_path / "batch.jsonl")
    env = {**os.environ, "DS_BUILD_OPS": "0", "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "",  # gloo on CPU
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / "build" / "torch_extensions"))
    (tmp_path / "ds").mkdir()
    args = {"out": str(tmp_path / "ds"), "student": str(tiny_model_dir), "teacher": str(perturbed_teacher),
            "batch": str(batch_file)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           __file__, json.dumps(args)]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # the reference trains while the workers start
    reference = TorchTrainer(tiny_model_dir, _trainer_cfg(), with_critic=False)
    batch = collate([Trajectory.from_json(line) for line in batch_file.read_text().splitlines()],
                    tokenizer.pad_token_id)
    start = reference.policy_state_dict()
    ref_history, ref_weights = _steps(reference, batch, str(tiny_model_dir), str(perturbed_teacher), tokenizer,
                                      tmp_path / "torch")
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-4000:]
    results = torch.load(tmp_path / "ds" / "results.pt", weights_only=False)
    moved = max(float((ref_weights[0][k] - v).abs().max()) for k, v in start.items())
    for zero, res in results.items():
        assert res["world"] == 2
        worst_rel = worst_weight = 0.0
        for step, (ours, ref, w_ours, w_ref) in enumerate(zip(res["history"], ref_history, res["weights"],
                                                              ref_weights)):
            assert ours.keys() == ref.keys() and {"policy_loss", "divergence"} <= set(ref)
            for key in ref:
                rel = abs(ours[key] - ref[key]) / max(abs(ref[key]), 1e-6)
                worst_rel = max(worst_rel, rel)
                assert rel < RTOL, f"ZeRO-{zero} {SETTINGS[step]} {key}: deepspeed {ours[key]} vs torch {ref[key]}"
            assert w_ours.keys() == w_ref.keys()
            diff = max(float((w_ours[k] - w_ref[k]).abs().max()) for k in w_ref)
            worst_weight = max(worst_weight, diff)
            assert diff < WEIGHT_ATOL, f"ZeRO-{zero} setting {SETTINGS[step]}: weights differ by {diff}"
        print(f"\nOPD ZeRO-{zero} vs torch over {len(SETTINGS)} steps: metrics rel {worst_rel:.2e}, weights "
              f"{worst_weight:.2e} (the first step moved weights by up to {moved:.2e})")
    assert moved > 100 * WEIGHT_ATOL  # the steps train: a matching no-op would not pass



def test_opd_sao_run_distils_at_top_k_and_top_p_on_two_deepspeed_ranks(tmp_path, free_port):
    """`opd-sao run` under torchrun: a teacher stage (torch backend), then an OPD stage at ZeRO-2 over 2 ranks with
    a top_k and a top_p teacher and the task reward mixed in."""
    import yaml

    tiny = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1}
    teachers = [{"name": "t_rev", "checkpoint": "rev", "domains": ["digits_reverse"]},
                {"name": "t_sort", "checkpoint": "rev", "domains": ["digits_sort"], "granularity": "top_p"}]
    config = {"seed": 2, "model": {"tiny": tiny}, "logging": {"wandb": False, "progress": False},
              "trainer": {"train_batch_size": 4, "critic_warmup_steps": 0},
              "stages": [{"name": "rev", "kind": "reasoning", "env": "digits_reverse", "init_from": "base", "steps": 1,
                          "sft": {"steps": 3, "batch_size": 8}, "rollout": {"max_new_tokens": 4},
                          "eval": {"num_tasks": 4}},
                         {"name": "opd", "kind": "opd", "init_from": "base", "steps": 2, "domains": DOMAINS,
                          "rollout": {"max_new_tokens": 4}, "eval": {"num_tasks": 4},
                          "trainer": {"backend": "deepspeed"},
                          # a fixed budget: a held-out probe would end the stage at step 0 (its teachers score 0)
                          "opd": {"granularity": "top_k", "top_k": 8, "reward_weight": 0.5, "max_resident": 1,
                                  "vocab_chunk": 128, "teachers": teachers, "probe_every": 0}}]}
    (tmp_path / "opd.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "DS_BUILD_OPS": "0", "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / "build" / "torch_extensions"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "opd_sao.app.cli", "run", str(tmp_path / "opd.yaml"), "--run-dir", str(tmp_path / "run")]
    result = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    metrics = tmp_path / "run" / "stages" / "opd" / "metrics.jsonl"
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(steps) == 2
    for m in steps:
        assert m["support_size_top_k"] == 8.0 and m["support_size_top_p"] >= 1.0
        assert m["divergence"] > 0 and np.isfinite(m["policy_grad_norm"]) and m["policy_grad_norm"] > 0


if __name__ == "__main__":
    worker(json.loads(sys.argv[-1]))
    from opd_sao.trainers.deepspeed_backend import shut_down

    shut_down(0)  # without interpreter teardown (see tests/test_deepspeed.py)
