"""Micro-batches and token budgets: a step's update is the whole batch's, on both trainer backends.

One fixed batch of 16 trajectories of varied length (the tiny student's own tokens and logprobs, groups of 4,
two domains) and one learner step per algorithm in float64 (`trainer.dtype: float64`): SAO (critic and
policy), GRPO (group-normalised advantages) and OPD at top_k with the task reward mixed in (the support
forward and the sampled-token forward in one update). Each step runs on the whole batch, in 4 micro-batches
of 4 trajectories, and under a token budget that packs them into several micro-batches; the weights after
the step must agree within 1e-6 of the update's size (measured: about 1e-13, the test prints it). The
DeepSpeed backend does the same on 2 gloo ranks (this file is also its worker script); there the gradients each
optimizer step applies agree within 1e-6 of their largest, the weights within DS_RTOL (float32 master weights).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
DOMAINS = ["digits_reverse", "digits_sort"]
ALGOS = ["sao", "grpo", "opd_top_k"]
BUDGET = 60  # padded tokens per micro-batch: the 16 rows (11-19 tokens) go in 5 micro-batches
SPLITS = {"micro_batch_size": {"micro_batch_size": 4}, "token_budget": {"max_tokens_per_micro_batch": BUDGET},
          "checkpointed": {"micro_batch_size": 4, "gradient_checkpointing": True}}
RTOL = 1e-6
DS_RTOL = 1e-2  # the DeepSpeed-vs-torch tolerance of test_deepspeed.py (1e-5 on an lr-1e-3 update): ZeRO's
# float32 master weights round each weight to 1.2e-7 of its size


def test_micro_batches_pack_by_length_within_the_limits():
    from opd_sao.trainers.micro_batches import micro_batches

    lengths = torch.tensor([5, 9, 3, 9, 7, 2])
    assert [p.tolist() for p in micro_batches(lengths, None, None)] == [[0, 1, 2, 3, 4, 5]]
    # longest first: 9, 9 | 7, 5 | 3, 2
    assert [p.tolist() for p in micro_batches(lengths, 2, None)] == [[1, 3], [0, 4], [2, 5]]
    # 2 x 9 = 18 fits 20, a third 9-wide row would not; 7 + 5 + ... : 3 x 7 = 21 > 20; a 12-token budget puts
    # each long row alone
    assert [p.tolist() for p in micro_batches(lengths, None, 20)] == [[1, 3], [0, 4], [2, 5]]
    assert [p.tolist() for p in micro_batches(lengths, None, 21)] == [[1, 3], [0, 2, 4], [5]]
    assert [p.tolist() for p in micro_batches(lengths, None, 8)] == [[1], [3], [4], [0], [2, 5]]
    assert [p.tolist() for p in micro_batches(lengths, 1, 100)] == [[1], [3], [4], [0], [2], [5]]


def batch_file(student, tokenizer, path: Path) -> Path:
    """16 trajectories of the student's own tokens (its float32 logprobs as rollout logprobs), 4 groups of 4,
    varied lengths and rewards, the last group on the second domain."""
    from opd_sao.checkpoints import load_causal_lm
    from opd_sao.model.modeling import sequence_logprobs
    from opd_sao.trajectory import Trajectory

    model, rng, lines = load_causal_lm(student), np.random.default_rng(0), []
    for i in range(16):
        domain = DOMAINS[int(i >= 12)]
        prompt = [tokenizer.bos_token_id] + rng.integers(5, 200, size=6 + i % 5).tolist()
        tokens = rng.integers(5, 200, size=2 + (5 * i) % 7).tolist()
        seq = torch.tensor([prompt + tokens])
        with torch.no_grad():
            logp = sequence_logprobs(model, seq, torch.ones_like(seq))[0, len(prompt):].tolist()
        lines.append(Trajectory(traj_id=f"t{i}", domain=domain, prompt_ids=prompt, token_ids=tokens,
                                action_mask=[1] * len(tokens), rollout_logp=logp, versions=[0] * len(tokens),
                                rewards=[0.0] * (len(tokens) - 1) + [0.1 + 0.3 * (i % 3) + 0.05 * i],
                                meta={"group": i // 4}).to_json())
    path.write_text("\n".join(lines) + "\n")
    return path


def learner(backend, algo: str, student: str, teacher: str, tokenizer, work: Path):
    from opd_sao.config import AlgoConfig, OPDConfig
    from opd_sao.rl.learner import Learner

    if algo != "opd_top_k":
        return Learner(backend, algo, AlgoConfig(), critic_steps=2, critic_warmup_steps=0), None
    from opd_sao.rl.distill import OPDLearner
    from opd_sao.teachers import Prefetcher, TeacherSet, TeacherTargets

    teachers = [{"name": f"t_{d}", "checkpoint": teacher, "domains": [d]} for d in DOMAINS]
    cfg = OPDConfig(teachers=teachers, granularity="top_k", top_k=8, vocab_chunk=100, reward_weight=0.5)
    reg = TeacherSet.from_config(cfg, domains=DOMAINS, resolve=Path, student_checkpoint=student,
                                 student_tokenizer=tokenizer)
    prefetcher = Prefetcher(reg.build_all(), local_dir=work / "tier", max_resident=1)
    return OPDLearner(backend, cfg, AlgoConfig(), TeacherTargets(reg, prefetcher, work / "cache")), prefetcher


def trainer_cfg(dtype="float64", **kw):
    from opd_sao.config import TrainerConfig

    return TrainerConfig(policy_lr=1e-3, critic_lr=1e-3, critic_steps=2, critic_warmup_steps=0, dtype=dtype, **kw)


def all_steps(make_backend, batch, student, teacher, tokenizer, work: Path, dtype="float64") -> dict:
    """{(algo, split): the policy's weights before and after a step of `algo`, its metrics}: one backend per
    split (the whole batch, then each of SPLITS) takes one step of each algorithm in turn."""
    results = {}
    for name, split in {"whole": {}, **SPLITS}.items():
        backend = make_backend(trainer_cfg(dtype, **split))
        for algo in ALGOS:
            before = backend.policy_state_dict()
            step, prefetcher = learner(backend, algo, student, teacher, tokenizer, work / name / algo)
            metrics = step.step(batch, 1.0)
            if prefetcher is not None:
                prefetcher.close()
            results[(algo, name)] = {"before": before, "after": backend.policy_state_dict(), "metrics": metrics}
    return results


def compare(results: dict, rtol: float = RTOL) -> float:
    """The worst difference between a split step's update and the whole batch's, relative to the update's size;
    the losses and gradient norms within RTOL."""
    worst = 0.0
    for algo in ALGOS:
        whole = results[(algo, "whole")]
        update = {k: whole["after"][k] - whole["before"][k] for k in whole["after"]}
        size = max(float(u.abs().max()) for u in update.values())
        assert size > 1e-5, f"{algo}: the step did not train"
        for name in SPLITS:
            ours = results[(algo, name)]
            diff = max(float((ours["after"][k] - ours["before"][k] - update[k]).abs().max()) for k in update)
            worst = max(worst, diff / size)
            assert diff < rtol * size, f"{algo} {name}: the update differs by {diff:.3e} (update size {size:.3e})"
            for key in ("policy_loss", "policy_grad_norm", "critic_grad_norm", "value_loss", "divergence"):
                if key in whole["metrics"]:
                    assert ours["metrics"][key] == pytest.approx(whole["metrics"][key], rel=RTOL), key
    return worst


def test_split_steps_match_the_whole_batch_torch(tmp_path, tiny_model_dir, perturbed_teacher, tokenizer):
    from opd_sao.trainers import TorchTrainer
    from opd_sao.trainers.base import split
    from opd_sao.trainers.micro_batches import Rows
    from opd_sao.trajectory import Trajectory, collate

    path = batch_file(tiny_model_dir, tokenizer, tmp_path / "batch.jsonl")
    batch = collate([Trajectory.from_json(line) for line in path.read_text().splitlines()], tokenizer.pad_token_id)
    assert len(split(Rows.of(batch), trainer_cfg(**SPLITS["micro_batch_size"]))) == 4
    assert len(split(Rows.of(batch), trainer_cfg(**SPLITS["token_budget"]))) >= 4

    def make(cfg):
        backend = TorchTrainer(tiny_model_dir, cfg, attn_implementation="sdpa")
        assert backend.policy.is_activation_checkpointing == backend.critic.backbone.is_activation_checkpointing \
            == cfg.gradient_checkpointing
        return backend

    worst = compare(all_steps(make, batch, str(tiny_model_dir), str(perturbed_teacher), tokenizer, tmp_path))
    print(f"\ntorch: split updates vs whole batch, worst relative difference {worst:.2e}")


class SavedActivations:
    """Bytes of the tensors autograd keeps for the backward, alive at once at the peak (saved_tensors_hooks)."""

    def __init__(self):
        self.live = self.peak = 0

    def pack(self, tensor):
        return _Saved(self, tensor)

    @staticmethod
    def unpack(saved):
        return saved.tensor


class _Saved:
    def __init__(self, owner: SavedActivations, tensor: torch.Tensor):
        self.owner, self.tensor, self.bytes = owner, tensor, tensor.numel() * tensor.element_size()
        owner.live += self.bytes
        owner.peak = max(owner.peak, owner.live)

    def __del__(self):
        self.owner.live -= self.bytes


def test_a_split_step_keeps_one_micro_batch_of_activations(tmp_path, tiny_model_dir, tokenizer):
    """The memory a step keeps for its backward (policy and critic): 4 micro-batches keep about a quarter of the
    whole batch's (the widest micro-batch's), gradient checkpointing (each decoder layer's input only) less still.
    Measured on this batch: 2.34 MB whole, 0.68 MB in 4 micro-batches, 0.10 MB with checkpointing too."""
    from opd_sao.config import TrainerConfig
    from opd_sao.trainers import TorchTrainer
    from opd_sao.trajectory import Trajectory, collate

    path = batch_file(tiny_model_dir, tokenizer, tmp_path / "batch.jsonl")
    batch = collate([Trajectory.from_json(line) for line in path.read_text().splitlines()], tokenizer.pad_token_id)
    peaks = {}
    for name, split in {"whole": {}, **SPLITS}.items():
        backend = TorchTrainer(tiny_model_dir, TrainerConfig(**split), attn_implementation="sdpa")
        saved = SavedActivations()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            logp = backend.policy_logprobs(batch, 1.0, grad=True)
            backend.step_policy(-(logp * batch.action_mask).sum() / batch.action_mask.sum())
            values = backend.critic_values(batch, grad=True)
            backend.step_critic(((values - 1) ** 2 * batch.action_mask).sum())
        peaks[name] = saved.peak
        assert saved.live == 0  # nothing kept after the step
    print("\npeak saved activations (bytes):", peaks)
    assert peaks["micro_batch_size"] < 0.4 * peaks["whole"] and peaks["token_budget"] < 0.4 * peaks["whole"]
    assert peaks["checkpointed"] < 0.5 * peaks["micro_batch_size"]


def record_optimizer_steps() -> list[list[torch.Tensor]]:
    """Every optimizer step's gradients from now on, as the torch optimizer applies them (torch's global step
    pre-hook): at ZeRO stage 0 the model's own gradients, reduced over the ranks; under ZeRO the flat float32
    partitions of this rank's share, reduced and clipped, that DeepSpeed hands its wrapped optimizer."""
    steps: list[list[torch.Tensor]] = []

    def record(optimizer, args, kwargs):
        steps.append([p.grad.detach().clone() for group in optimizer.param_groups for p in group["params"]
                      if p.grad is not None])

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(record)
    return steps


def worker(args: dict) -> None:
    """Rank 0: every step at the ZeRO stage asked for, over 2 ranks; the other rank follows. Each rank saves the
    gradients its optimizer steps applied."""
    from launchers import deepspeed_rank0_batch

    from opd_sao.trainers.deepspeed_backend import DeepSpeedTrainer

    steps = record_optimizer_steps()
    rank0 = deepspeed_rank0_batch(args["student"], args["batch"])
    out = Path(args["out"])
    if rank0 is None:
        torch.save(steps, out / f"gradients_{os.environ['RANK']}.pt")
        return
    tokenizer, batch = rank0

    def make(cfg):
        ds = cfg.model_copy(update={"backend": "deepspeed",
                                    "deepspeed_config": {"zero_optimization": {"stage": args["stage"]}}})
        return DeepSpeedTrainer(args["student"], ds, attn_implementation="sdpa")

    results = all_steps(make, batch, args["student"], args["teacher"], tokenizer, out, args["dtype"])
    torch.save({"results": results}, out / "results.pt")
    torch.save(steps, out / "gradients_0.pt")


def compare_gradients(ranks: list[list[list[torch.Tensor]]]) -> float:
    """The worst difference between a split step's applied gradients and the whole batch's, relative to the
    largest element of that step's gradient (over both ranks). Every backend (whole, then each of SPLITS) takes the
    same optimizer steps in the same order, so each rank's record is 1 + len(SPLITS) equal runs."""
    runs = 1 + len(SPLITS)
    assert all(len(steps) % runs == 0 and steps for steps in ranks)
    n, worst = len(ranks[0]) // runs, 0.0
    for step in range(n):
        size = max(float(g.abs().max()) for steps in ranks for g in steps[step])
        assert size > 0, f"optimizer step {step} applied no gradient"
        for run in range(1, runs):
            diff = max(float((g - w).abs().max()) for steps in ranks
                       for g, w in zip(steps[run * n + step], steps[step], strict=True))
            worst = max(worst, diff / size)
    return worst


@pytest.mark.parametrize("stage, dtype", [(2, "float64"), (3, "float32")])
def test_split_steps_match_the_whole_batch_deepspeed(stage, dtype, tmp_path, tiny_model_dir, perturbed_teacher,
                                                     tokenizer, free_port):
    """What DeepSpeed 0.19.8 can hold to 1e-6 is the gradient each optimizer step applies (measured: 2.1e-7 at
    ZeRO-2 on a float64 model, 3.7e-7 at ZeRO-3 in float32), not the weights' update (1.2e-4, 6.4e-4). ZeRO keeps
    float32 master weights (stage_1_and_2's single_partition_of_fp32_groups, stage3's fp32_partitioned_groups_flat)
    and accumulates and reduces gradients in float32 (engine.get_data_types: grad_accum_dtype is fp16, bf16 or fp32),
    so a weight near 1 moves in float32 steps of 1.2e-7 against an lr-1e-3 update, and Adam's first steps divide a
    nearly cancelling gradient's float32 rounding by its size: the updates are held to DS_RTOL. A float64 run is
    not possible elsewhere either: ZeRO-3 refuses float64 parameters (partition_parameters.Init asserts half, bf16
    or float) and stage 0 cannot reduce them (engine.split_half_float_double_sparse asserts the accelerator's
    supported_dtypes: cpu float, bf16, fp16; cuda float, half, bf16)."""
    path = batch_file(tiny_model_dir, tokenizer, tmp_path / "batch.jsonl")
    env = {**os.environ, "DS_BUILD_OPS": "0", "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "",  # gloo on CPU
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / "build" / "torch_extensions"))
    args = {"out": str(tmp_path), "student": str(tiny_model_dir), "teacher": str(perturbed_teacher),
            "batch": str(path), "stage": stage, "dtype": dtype}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           __file__, json.dumps(args)]
    result = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    gradients = compare_gradients([torch.load(tmp_path / f"gradients_{r}.pt") for r in range(2)])
    updates = compare(torch.load(tmp_path / "results.pt", weights_only=False)["results"],
                      DS_RTOL)
    print(f"\ndeepspeed (2 ranks, ZeRO stage {stage}, {dtype}): split vs whole batch, worst relative difference: "
          f"applied gradients {gradients:.2e}, updates {updates:.2e}")
    assert gradients < RTOL, f"applied gradients differ by {gradients:.2e} of their largest element"


if __name__ == "__main__":
    worker(json.loads(sys.argv[-1]))
    from opd_sao.trainers.deepspeed_backend import shut_down

    shut_down(0)
