"""Supervised warm start on an environment's reference solutions, so a tiny model starts above zero."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Optional

from opd_sao.algorithms import sft_loss
from opd_sao.checkpoints import PromptFormat
from opd_sao.config import SFTConfig, TrainerConfig
from opd_sao.errors import UsageError
from opd_sao.io.tracking import MetricsLogger
from opd_sao.runs.checkpointing import StageState, truncate_step_log
from opd_sao.trainers import build_backend
from opd_sao.trajectory import Batch, Trajectory, collate

STATE, LOG = "sft_state", "sft.jsonl"  # in run_sft's work_dir


def sft_examples(env_factory, tokenizer, n: int, seed: int,
                 prompt_format: Optional[PromptFormat] = None) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids + eos) from the train split's reference actions, in the stage's prompt format."""
    env = env_factory()
    fmt = prompt_format or PromptFormat(tokenizer)
    examples = []
    for task in env.make_tasks("train", n, seed):
        actions = env.reference_actions(task)
        if not actions:
            continue
        examples.append((fmt.prompt(env.reset(task)), fmt.answer(actions[0])))
    if not examples:
        raise UsageError("the environment gives no reference actions, so SFT warm start has nothing to learn from")
    return examples


def sft_resume_step(work_dir: Path) -> int:
    """The step an interrupted run_sft saved in `work_dir` (0 when there is none): where `resume=True` continues."""
    return StageState(work_dir, STATE).step() or 0


def discard_sft_state(work_dir: Path) -> None:
    """Before a fresh start: an earlier run's state and step log must not be continued."""
    StageState(work_dir, STATE).discard()
    (Path(work_dir) / LOG).unlink(missing_ok=True)


def sft_batch(chosen: list[tuple[list[int], list[int]]], pad_id: int) -> Batch:
    """(prompt, answer) pairs as a trainer batch: the answer tokens are the actions, sampled at temperature 1."""
    trajectories = []
    for i, (prompt, answer) in enumerate(chosen):
        traj = Trajectory(f"sft{i}", "sft", list(prompt))
        traj.append(answer, action=True, logp=[0.0] * len(answer), versions=[0] * len(answer))
        trajectories.append(traj)
    return collate(trajectories, pad_id)


def run_sft(checkpoint: Path, out_dir: Path, examples, tokenizer, cfg: SFTConfig, seed: int, progress=None, *,
            trainer: Optional[TrainerConfig] = None, work_dir: Optional[Path] = None, save_every: int = 0,
            resume: bool = False, attn_implementation: str = "eager") -> Path:
    """SFT from `checkpoint` on the `trainer` backend (default: torch on the run's device); returns the HF-format
    `out_dir`, written atomically.

    The backend is the RL stages' (`trainer.backend`: torch, or DeepSpeed ZeRO 1-3 over the launched ranks) at
    `sft.lr`, so a model that needs ZeRO to train needs no other path to its warm start; its precision is
    `trainer.dtype` (float32 weights, bfloat16 compute under autocast). The loss is the token-mean negative
    log-likelihood of the answers (the prompt is context only). Its micro-batches, gradient checkpointing and lr
    schedule (over the SFT's own steps) are `trainer`'s; `attn_implementation` is model.attn_implementation.

    With `work_dir` it is resumable, like an RL stage: work_dir/sft.jsonl gets one line per step (loss and the
    indices of the examples trained on), and every `save_every` steps the backend's state and the sampler go to
    work_dir/sft_state/ (swapped in whole, runs.checkpointing.StageState). With `resume` it continues from the
    saved step with the log cut back to it: a step counts as trained only if the weights that learnt from it were
    saved, and the examples drawn are the ones an uninterrupted run draws. The state is removed once `out_dir` is
    written.
    """
    trainer = (trainer or TrainerConfig()).model_copy(update={"policy_lr": cfg.lr})
    backend = build_backend(trainer, checkpoint, with_critic=False, attn_implementation=attn_implementation,
                            total_steps=cfg.steps)
    rng, start, state = random.Random(seed), 0, None
    if work_dir is not None:
        state = StageState(work_dir, STATE)
        if resume and state.step() is not None:
            saved = state.load(backend)
            rng.setstate((saved["rng"][0], tuple(saved["rng"][1]), saved["rng"][2]))
            start = saved["step"]
        truncate_step_log(Path(work_dir) / LOG, start)
    logger = MetricsLogger(Path(work_dir) / LOG, stage="sft") if work_dir is not None else None
    if progress is not None:
        progress.update(start)
    for step in range(start, cfg.steps):
        picks = [rng.randrange(len(examples)) for _ in range(cfg.batch_size)]
        batch = sft_batch([examples[i] for i in picks], tokenizer.pad_token_id)
        logp = backend.policy_logprobs(batch, 1.0, grad=True)
        loss = sft_loss(logp, batch.action_mask.to(logp.device))
        backend.step_policy(loss)
        if progress is not None:  # the figures first: the line `update` may print shows this step's
            progress.set_postfix(loss=f"{loss.item():.3f}")
            progress.update(1)
        if logger is not None:
            logger.log({"loss": round(loss.item(), 5), "examples": picks}, step)
            if save_every and (step + 1) % save_every == 0 and step + 1 < cfg.steps:
                state.save(backend, step + 1, {"rng": rng.getstate()})
    checkpoint = backend.export_policy(out_dir, tokenizer)
    if state is not None:
        state.discard()
    return checkpoint
