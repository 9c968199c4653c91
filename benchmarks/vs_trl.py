r"""opd-sao against TRL on the same RL work, both sides in one invocation (TRL in a venv of its own, as a user has it).

The work: from one SFT start (the tiny model warmed up on arithmetic), `--steps` policy steps of `--batch` episodes on
the arithmetic environment's train split (the project's own generator; reward 1 for exactly the answer), at the same
temperature, max_new_tokens, policy lr, AdamW betas, weight decay, gradient clip and ratio clip. Five runs: opd-sao
SAO (one rollout per prompt, asynchronous, critic K=2 updates each over the whole batch), the same SAO with its two
critic updates on the batch's two halves (`trainer.critic_minibatches`: one pass), opd-sao GRPO (groups of 8) and
TRL's GRPOTrainer (groups of 8, beta 0, one iteration per generation), judged at TRL's default gradient checkpointing
and run again without it (ratios `*_vs_trl_no_checkpointing`, reported, not judged: opd-sao's side does not
checkpoint at this size, and a TRL user would turn it off for it too). Each runs in its own process at ONE torch
thread; its cost is its own CPU-seconds (getrusage of the process and its children, around the training only: model
loading and trainer construction excluded on both sides; opd-sao's consistency gate, two checks per stage whatever its
length, reported beside as `gate_cpu_s`, and the ratios with it included printed too). Every final model is then
scored by the same held-out evaluation (the eval split, `--eval-samples` sampled episodes per task at temperature 1,
the project's verifier).

Along the run (`--snapshots N`, default 4): the judged RL rows (SAO, SAO with critic mini-batches, opd-sao GRPO,
TRL GRPO) also keep their policy after each 1/N of the steps, at the end of the optimizer step on both sides (a copy
in memory, written after the run; the copy's CPU is taken out of every figure), and each is evaluated alike:
held-out accuracy against CPU-seconds.
From it, reported and not judged (`at_equal_cpu`): each opd-sao row's accuracy at TRL's CPU-seconds, and the CPU
each side took to first reach TRL's final accuracy (the Must-show compares cost per episode; these compare cost to
the same accuracy).

The OPD row, at the tiny model's vocabulary (384): `--opd-steps` steps of `--batch` on-policy episodes distilling
one teacher (the start after as many SFT steps again) with forward KL. opd-sao: its OPD stage's learner, top_k 16
through the logit cache (scoring, quantising, training, and the writer committing every record inside the clock);
TRL: DistillationTrainer (on-policy generation, the teacher's forward, the exact full-vocabulary forward KL at
`beta` 0, TRL's default gradient checkpointing). Both generate their own rollouts. The cost is CPU-seconds per step
and the process's peak RSS.

Every opd-sao row runs twice: with `engine.overlap: false` (the embedded engine and the trainer take turns, one
computing at a time like TRL's single thread: the rows judged against the Must-show) and at the default `true`
(generation overlapping training on a second core: less wall time, more CPU at this size), suffixed `_overlap`.

`--repeats N` runs the RL rows and the vocabulary-384 OPD rows N times, interleaved (opd-sao, then TRL, in every
repeat), and judges the median of each ratio: on this 2-core machine one run's ratio moves by up to a quarter
between runs. Repeat r trains from seed `--seed` + r (every side), and every repeat's final models are evaluated: a
run's held-out accuracy is the mean over the repeats (each repeat's beside it), since one training run per
algorithm moves by more than the evaluation's own error. `--pin-core C` runs every worker, both sides,
on core C alone: TRL's single thread is unaffected, while every thread of an opd-sao row shares the one core.

Real-model mode (`--model DIR --config YAML --env NAME --out-dir DIR`): the same comparison from a checkpoint of
one's own (e.g. SmolLM2 after configs/smollm2.yaml's reasoning-stage format SFT) on the config's stage that trains
`--env` (e.g. `reasoning_gym:basic_arithmetic`): that stage's env_options, rollout, trainer and rl settings as the
pipeline resolves them (policy_lr, prompt_format chat where the tokenizer has a template, gradient checkpointing,
attention), `--prompt-format`, `--max-new-tokens` and `--threads` (default: the config's torch_threads) over them;
no tiny model, no SFT. Three rows only, all judged: opd-sao SAO, opd-sao GRPO (both `engine.overlap: false`) and
TRL GRPO (checkpointing as the config's trainer); no OPD, overlap, mini-batch or no-checkpointing rows. TRL's
prompts are opd-sao's rendered prompts (the chat template's text, the same tokens), and its reward function is the
project's environment (`ENVIRONMENTS.get(env)(**env_options).step`: for reasoning-gym its own scorer on the final
<answer>, strict), imported from opd-sao's venv appended after TRL's own packages. `--cpu-budget S` stops every
row after the step where its training CPU-seconds reach S (snapshots then at every 1/N of S), so each side gets the
same CPU; held-out: `--eval-tasks` items (>= 200 for the Must-show), `--eval-samples` samples each at the rollout
temperature (greedy with `--eval-greedy`), standard error over the items beside each score. Writes `<out-dir>/vs_trl.png` (held-out accuracy against CPU-seconds, every row, +-1 SE) and
`<out-dir>/result.json` (the JSON line); judged: SAO's accuracy at or above each other row's at each of that row's
points (equal CPU, SAO's curve interpolated), each with the standard error of SAO's lead paired over the items. `--critic-trained-layers N` adds SAO with a critic that trains its last
N layers only (`trainer.critic_trained_layers`: a cheaper step), judged alike; `--rows-from DIR` takes the rows an
earlier run with the same settings has (its result.json) and runs only the others; `--combine DIR... --out-dir OUT`
pools runs that differ only in `--seed` (mean curves, SAO judged on them, SAO's lead at each point per seed and its
standard error over the seeds) and runs nothing. SmolLM2's reasoning stage (#41):

    benchmarks/vs_trl.py --venv /tmp/trlbench --model RUN/stages/reasoning/sft_checkpoint \
        --config configs/smollm2.yaml --env reasoning_gym:basic_arithmetic --prompt-format chat \
        --max-new-tokens 48 --threads 2 --batch 16 --steps 400 --cpu-budget 1500 --snapshots 4 \
        --eval-tasks 250 --eval-samples 4 --out-dir /tmp/vs_trl_smollm2

(measured: docs/benchmarks.md, "opd-sao against TRL on the same RL work").

TRL is installed into `<--venv>/trl-venv` with `python -m venv` and pip (trl==1.16.0, the same torch 2.13.0 CPU
wheel and transformers as opd-sao's venv), once; later runs reuse it.

Prints a table and, on its last line, one JSON object: episodes per CPU-second of each run, the ratios to TRL, the
held-out accuracies and the OPD row's CPU and memory.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRL_VERSION = "1.16.0"
GROUP = 8  # GRPO's rollouts per prompt, both sides
OPD_TOP_K = 16  # the OPD rows: the teacher's top 16 per token (opd-sao); TRL's loss is over the whole vocabulary
SETTINGS = {"temperature": 1.0, "max_new_tokens": 6, "policy_lr": 3e-4, "grad_clip": 1.0, "ratio_clip": 0.2,
            "max_operand": 30}


def cpu_seconds() -> float:
    """This process's and its finished children's CPU time (user + system), every thread included."""
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


def peak_mb() -> float:
    """This process's peak resident set (MB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


THREADS = 1  # torch threads of every worker, either side (--threads; the tiny model runs fastest on one)


def thread_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(THREADS), "MKL_NUM_THREADS": str(THREADS),
            "TOKENIZERS_PARALLELISM": "false", "PYTHONHASHSEED": "0"}


class Snapshots:
    """The policy's weights after `parts` - 1 evenly spaced steps (either side, same steps), each with the training's
    CPU-seconds up to it: the held-out accuracy along the run, against CPU. During the run a snapshot is only a
    copy in memory (a checkpoint written mid-run may disturb the loop beyond its own cost); the copies are written
    after the clock stops, and what copying costs is kept out of the points and the run's total
    (`saving`), so the judged ratios are the same with or without."""

    def __init__(self, steps: int, parts: int, out: Path, cpu_budget: float | None = None):
        self.at = {steps * i // parts for i in range(1, parts)} - {0} if parts > 1 else set()
        self.out, self.cpu0, self.saving, self.points = out, 0.0, 0.0, []
        self.parts, self.cpu_budget = parts, cpu_budget  # with a budget: after each 1/parts of it, not of the steps

    def start(self, cpu0: float) -> None:
        self.cpu0 = cpu0

    def spent(self) -> float:
        """The training's CPU-seconds so far, copying excluded."""
        return cpu_seconds() - self.cpu0 - self.saving

    def over_budget(self, steps_done: int = 0) -> bool:
        """Whether the training has used `cpu_budget` (never without one): the loops' stop check."""
        return self.cpu_budget is not None and self.spent() >= self.cpu_budget

    def after(self, steps_done: int, state_dict) -> None:
        """`state_dict()` gives the policy's weights, copied if `steps_done` is one of the snapshot steps (with a
        CPU budget: the first step after the next 1/parts of it)."""
        if self.cpu_budget is None:
            if steps_done not in self.at:
                return
        elif len(self.points) >= self.parts - 1 or self.spent() < self.cpu_budget * (len(self.points) + 1) / self.parts:
            return
        cpu = cpu_seconds()
        weights = {name: tensor.detach().to("cpu", copy=True) for name, tensor in state_dict().items()}
        self.points.append({"step": steps_done, "cpu_s": cpu - self.cpu0 - self.saving, "weights": weights})
        self.saving += cpu_seconds() - cpu

    def write(self, model, save) -> list[dict]:
        """After the clock (and after the final model is written): each snapshot's weights loaded into `model` and
        written by `save(path)`; the points, each with its checkpoint's path."""
        for point in self.points:
            model.load_state_dict(point.pop("weights"))
            point["checkpoint"] = str(self.out / f"step{point['step']}")
            save(Path(point["checkpoint"]))
        return self.points


# ------------------------------------------------------------------ opd-sao side (the repository's venv)

def run_config(start: Path, algo: str, steps: int, batch: int, seed: int, teacher: Path | None = None,
               granularity: str = "top_k", max_new_tokens: int = SETTINGS["max_new_tokens"], overlap: bool = True,
               critic_minibatches: bool = False):
    """The stage as a user configures it, resolved by the schema: the reasoning stage (quickstart's reasoning
    settings), or with `algo` "opd" an OPD stage distilling `teacher` (one teacher, top_k 16, forward KL, no
    probes: the whole budget trains). `critic_minibatches`: SAO's K critic updates on K mini-batches of the batch
    (one pass) instead of K passes over it."""
    from opd_sao.config import RunConfig

    rollout = {"temperature": SETTINGS["temperature"], "max_new_tokens": max_new_tokens, "max_staleness": 2}
    if algo == "opd":
        stage = {"name": "opd", "kind": "opd", "steps": steps, "init_from": "base", "rollout": rollout,
                 "opd": {"teachers": [{"name": "teacher", "checkpoint": str(teacher), "domains": ["arithmetic"]}],
                         "granularity": granularity, "top_k": OPD_TOP_K, "divergence": "forward_kl", "probe_every": 0,
                         "score_batch_size": batch}}  # the teacher scores the batch in one pass, as TRL's does
    else:
        stage = {"name": "rl", "kind": "reasoning", "env": "arithmetic", "steps": steps,
                 "env_options": {"max_operand": SETTINGS["max_operand"]}, "rl": {"ppo_clip": SETTINGS["ratio_clip"]},
                 "rollout": rollout}
    return RunConfig.model_validate({
        "seed": seed, "algo": "sao" if algo == "opd" else algo, "model": {"path": str(start)},
        "logging": {"wandb": False, "progress": False},
        "engine": {"max_batch": batch, "overlap": overlap},  # TRL generates a step's whole batch at once
        "trainer": {"policy_lr": SETTINGS["policy_lr"], "critic_lr": 2e-3, "critic_steps": 2,
                    "critic_warmup_steps": 5, "critic_minibatches": critic_minibatches, "train_batch_size": batch,
                    "grad_clip": SETTINGS["grad_clip"]},
        "stages": [stage]})


def real_run_config(real: dict, start: Path, algo: str, steps: int, batch: int, seed: int):
    """Real-model mode: `real["config"]`'s stage that trains `real["env"]`, alone, from `start` (no SFT: the start
    is already warm), resolved by the schema as the pipeline resolves it (real-model defaults included), with
    `algo`, `steps`, `batch` episodes a step, the engine and trainer taking turns, and the CLI's prompt format,
    new-token budget, thread count and `real["trainer"]` settings (a variant row's) over the config's."""
    from opd_sao.config import load_yaml, parse_config
    from opd_sao.errors import UsageError

    data = load_yaml(Path(real["config"]).read_text(), real["config"])
    stage = next((s for s in data.get("stages", []) if s.get("env") == real["env"]), None)
    if stage is None:
        raise UsageError(f"{real['config']}: no stage with env {real['env']!r}")
    rollout = {**stage.get("rollout", {}), **({"max_new_tokens": real["max_new_tokens"]}
                                              if real.get("max_new_tokens") else {})}
    stage = {**{k: v for k, v in stage.items() if k != "sft"}, "steps": steps, "rollout": rollout,
             "trainer": {**stage.get("trainer", {}), "train_batch_size": batch}}
    data = {**data, "seed": seed, "algo": algo, "model": {**data.get("model", {}), "path": str(start)},
            "trainer": {**data.get("trainer", {}), **real.get("trainer", {})},
            "torch_threads": THREADS, "logging": {"wandb": False, "progress": False},
            "engine": {**data.get("engine", {}), "overlap": False}, "stages": [stage],
            **({"prompt_format": real["prompt_format"]} if real.get("prompt_format") else {})}
    return parse_config(data)


def opd_sao_worker(start: Path, out: Path, algo: str, steps: int, batch: int, seed: int,
                   teacher: Path | None = None, granularity: str = "top_k",
                   max_new_tokens: int = SETTINGS["max_new_tokens"], overlap: bool = True,
                   critic_minibatches: bool = False, snapshots: int = 0, real: dict | None = None,
                   cpu_budget: float | None = None) -> dict:
    """One stage's training as Stage.train runs it (gate at start and end, buffer write-ahead log, metrics, trained
    log, resumable state every checkpoint_every steps); CPU-seconds of the gate and the loop. With `algo` "opd": the
    OPD stage's learner over the teacher's logit cache (the teacher loaded before the clock starts, as TRL loads
    its teacher in the trainer's constructor; the cache's writer committing every record before it stops).
    `snapshots`, `cpu_budget`: see Snapshots; `real`: real-model mode's stage (real_run_config)."""
    import itertools

    import torch

    from opd_sao.checkpoints import load_tokenizer
    from opd_sao.consistency.gate import ConsistencyGate, probe_episodes
    from opd_sao.engines import build_engine
    from opd_sao.envs import ENVIRONMENTS, sample_tasks
    from opd_sao.io.tracking import MetricsLogger
    from opd_sao.rl.buffer import TrajectoryBuffer
    from opd_sao.rl.distill import OPDLearner
    from opd_sao.rl.learner import Learner, needs_critic
    from opd_sao.rl.loop import RLLoop
    from opd_sao.rl.rollout import episodes_for
    from opd_sao.runs.checkpointing import StageState
    from opd_sao.stages.base import TRAIN_TASK_POOL
    from opd_sao.teachers import Prefetcher, TeacherSet, TeacherTargets
    from opd_sao.trainers import build_backend

    torch.set_num_threads(THREADS)
    torch.manual_seed(seed)
    run = (real_run_config(real, start, algo, steps, batch, seed) if real else
           run_config(start, algo, steps, batch, seed, teacher, granularity, max_new_tokens, overlap, critic_minibatches))
    stage = run.stages[0]
    trainer_cfg, tok = run.stage_trainer(stage), load_tokenizer(start)
    distilling = algo == "opd"
    domain, env_options = ("arithmetic", {"max_operand": SETTINGS["max_operand"]}) if distilling else \
        (stage.env, stage.env_options)
    env_factory = lambda: ENVIRONMENTS.get(domain)(**env_options)
    attention = run.model.attn_implementation  # trainer and engine alike, as the stage has them
    backend = build_backend(trainer_cfg, start, with_critic=not distilling and needs_critic(algo),
                            attn_implementation=attention, total_steps=steps)
    engine = build_engine(run.engine, start, tok, seed=seed, device=run.device, attn_implementation=attention)
    if distilling:
        registry = TeacherSet.from_config(stage.opd, domains=["arithmetic"], resolve=Path, student_checkpoint=start,
                                          student_tokenizer=tok)
        prefetcher = Prefetcher(registry.build_all(), local_dir=out / "teacher_tier", max_resident=1)
        with prefetcher.use("teacher"):
            pass  # loaded and resident
        targets = TeacherTargets(registry, prefetcher, out / "logit_cache")
        learner = OPDLearner(backend, stage.opd, stage.rl, targets)
    else:
        learner = Learner(backend, algo, stage.rl, critic_steps=trainer_cfg.critic_steps,
                          critic_warmup_steps=trainer_cfg.critic_warmup_steps,
                          critic_minibatches=trainer_cfg.critic_minibatches)
    tasks = sample_tasks(env_factory().make_tasks("train", TRAIN_TASK_POOL, seed), seed)
    groups = itertools.count()

    def make_episodes():
        return episodes_for(env_factory, next(tasks), tok, stage.rollout, domain=domain,
                            count=stage.rollout.group_size, group=next(groups))

    gate = ConsistencyGate(stage.gate, stage="rl", out_dir=out, engine=engine, backend=backend,
                           make_probe=lambda: probe_episodes(env_factory, tok, stage.rollout, domain=domain,
                                                             n=stage.gate.probe_size, seed=seed),
                           eps_low=stage.rl.eps_low, eps_high=stage.rl.eps_high, deterministic=False,
                           pad_id=tok.pad_token_id)
    state = StageState(out)
    along = Snapshots(steps, snapshots, out, cpu_budget)

    def after_step(step: int) -> None:
        gate.after_step(step)
        if (step + 1) % stage.checkpoint_every == 0:
            state.save(backend, step + 1, {"learner": learner.state()})
        along.after(step + 1, backend.policy_model.state_dict)

    loop = RLLoop(engine=engine, learner=learner, make_episodes=make_episodes, rollout=stage.rollout,
                  train_batch_size=trainer_cfg.train_batch_size, pad_id=tok.pad_token_id,
                  logger=MetricsLogger(out / "metrics.jsonl", stage="rl"), trained_log=out / "trained.jsonl",
                  after_step=after_step, buffer=TrajectoryBuffer(stage.rollout.group_size, spill_dir=out / "buffer"),
                  stop_when=along.over_budget)
    cpu0 = cpu_seconds()
    gate.run("start", sync=loop.sync_weights)
    cpu1, wall1 = cpu_seconds(), time.perf_counter()
    along.start(cpu1)
    history = loop.run(steps)
    if distilling:
        targets.flush()  # every record committed: the cache's writing is part of the steps' cost
    cpu2, wall2 = cpu_seconds(), time.perf_counter()
    gate.run("final", sync=loop.sync_weights)
    gate_cpu = (cpu1 - cpu0) + (cpu_seconds() - cpu2)  # the gate's two checks: once per stage, not per step
    backend.export_policy(out / "checkpoint", tok)
    engine.close()
    along.write(backend.policy_model, lambda path: backend.export_policy(path, tok))
    result = {"episodes": len(history) * trainer_cfg.train_batch_size, "cpu_s": cpu2 - cpu1 - along.saving,
              "wall_s": wall2 - wall1, "snapshots": along.points, "gate_cpu_s": gate_cpu,
              "torch_threads": torch.get_num_threads(), "checkpoint": str(out / "checkpoint"),
              "peak_rss_mb": peak_mb(),
              "reward_last_quarter": sum(h["reward_mean"] for h in history[-len(history) // 4:])
              / max(1, len(history[-len(history) // 4:]))}
    if distilling:
        quarter = history[-steps // 4:]
        result["divergence_first_last_quarter"] = [sum(h["divergence"] for h in history[:steps // 4]) / max(1, steps // 4),
                                                   sum(h["divergence"] for h in quarter) / max(1, len(quarter))]
        targets.close()
        prefetcher.close(remove_copies=True)
    return result


def prepare(work: Path, sft_steps: int, seed: int) -> Path:
    """The shared start: the tiny model, SFT on arithmetic reference answers (the warm start of the quickstart's
    reasoning stage), and the train tasks written out for TRL's dataset; the OPD rows' teacher: the start after
    as many SFT steps again (`<work>/teacher`)."""
    import torch

    from opd_sao.checkpoints import PromptFormat, build_tiny_model, load_tokenizer
    from opd_sao.config import SFTConfig, TinyModelConfig, TrainerConfig
    from opd_sao.envs import ENVIRONMENTS
    from opd_sao.stages.base import TRAIN_TASK_POOL
    from opd_sao.supervised import run_sft, sft_examples

    torch.set_num_threads(THREADS)
    torch.manual_seed(seed)
    texts = [t for name in ENVIRONMENTS.names() for t in ENVIRONMENTS.get(name)().corpus(300)]
    base = build_tiny_model(work / "base", texts, TinyModelConfig(), seed=seed)
    tok = load_tokenizer(base)
    env_factory = lambda: ENVIRONMENTS.get("arithmetic")(max_operand=SETTINGS["max_operand"])
    examples = sft_examples(env_factory, tok, n=TRAIN_TASK_POOL, seed=seed, prompt_format=PromptFormat(tok))
    start = run_sft(base, work / "start", examples, tok, SFTConfig(steps=sft_steps, lr=3e-3, batch_size=64), seed,
                    trainer=TrainerConfig(device="cpu"))
    run_sft(start, work / "teacher", examples, tok, SFTConfig(steps=sft_steps, lr=3e-3, batch_size=64), seed,
            trainer=TrainerConfig(device="cpu"))
    train = env_factory().make_tasks("train", TRAIN_TASK_POOL, seed)
    (work / "train_tasks.json").write_text(json.dumps(train))
    return start


def held_out(checkpoint: Path, samples: int, seed: int) -> float:
    """The same evaluation for every side's final model: all eval tasks, `samples` episodes each, temperature 1."""
    import torch

    from opd_sao.checkpoints import load_tokenizer
    from opd_sao.config import EvalConfig, RolloutConfig
    from opd_sao.envs import ENVIRONMENTS
    from opd_sao.runs.evaluation import evaluate

    torch.set_num_threads(THREADS)
    env_factory = lambda: ENVIRONMENTS.get("arithmetic")(max_operand=SETTINGS["max_operand"])
    n = len(env_factory().all_tasks("eval"))
    rollout = RolloutConfig(temperature=SETTINGS["temperature"], max_new_tokens=SETTINGS["max_new_tokens"])
    return evaluate(checkpoint, env_factory, load_tokenizer(checkpoint), domain="arithmetic", rollout=rollout,
                    eval_cfg=EvalConfig(num_tasks=n, samples_per_task=samples, temperature=SETTINGS["temperature"]),
                    seed=seed, device="cpu")


def real_held_out(checkpoint: Path, real: dict, seed: int) -> dict:
    """Real-model mode's evaluation of every side's models: `eval_tasks` items of the stage's eval split, greedy with
    `eval_greedy` (else `eval_samples` samples per item at the rollout's temperature, keyed draws: every checkpoint
    meets the same random numbers), scored by the environment as in training; the mean, its standard error over the
    items and their number, and each item's mean (in the eval split's order, every checkpoint's alike: two are
    compared item by item)."""
    from opd_sao.checkpoints import load_tokenizer
    from opd_sao.config import EvalConfig
    from opd_sao.envs import ENVIRONMENTS
    from opd_sao.runs.evaluation import episode_rewards, task_score

    run = real_run_config(real, checkpoint, "sao", 1, 1, seed)
    stage = run.stages[0]
    rewards = episode_rewards(checkpoint, lambda: ENVIRONMENTS.get(stage.env)(**stage.env_options),
                              load_tokenizer(checkpoint), domain=stage.env, rollout=stage.rollout,
                              eval_cfg=EvalConfig(num_tasks=real["eval_tasks"], greedy=real["eval_greedy"],
                                                  samples_per_task=1 if real["eval_greedy"] else real["eval_samples"],
                                                  temperature=stage.rollout.temperature),
                              seed=seed, device="cpu", attn_implementation=run.model.attn_implementation)
    score = task_score(rewards)
    return {"held_out": score.mean, "held_out_stderr": score.stderr, "held_out_n": score.n,
            "held_out_per_task": [statistics.fmean(r) for r in rewards.values() if r]}  # the tasks in one order


def real_trl_inputs(real: dict, start: Path, seed: int, work: Path) -> dict:
    """Real-model mode's TRL side, from the stage as opd-sao resolves it: the train tasks with each prompt as text
    that TRL's tokenizer call turns into exactly the ids opd-sao's engine gets (checked; <work>/train_tasks.json)
    and the settings of its GRPOConfig and reward (<work>/trl_settings.json, returned)."""
    import site

    from opd_sao.checkpoints import PromptFormat, load_tokenizer
    from opd_sao.envs import ENVIRONMENTS
    from opd_sao.stages.base import TRAIN_TASK_POOL

    run = real_run_config(real, start, "grpo", 1, GROUP, seed)
    stage = run.stages[0]
    trainer = run.stage_trainer(stage)
    tok = load_tokenizer(start)
    fmt, env = PromptFormat.from_rollout(tok, stage.rollout), ENVIRONMENTS.get(stage.env)(**stage.env_options)
    rows = []
    for task in env.make_tasks("train", TRAIN_TASK_POOL, seed):
        ids = fmt.prompt(env.reset(task))
        text = tok.decode(ids)
        if tok(text)["input_ids"] != ids:  # TRL's call: the tokenizer on the text, special tokens at their default
            sys.exit(f"task {task['id']}: the rendered prompt does not tokenize back to opd-sao's ids; TRL would "
                     "see another prompt")
        rows.append({"text": text, "task": task})
    (work / "train_tasks.json").write_text(json.dumps(rows))
    settings = {"temperature": stage.rollout.temperature, "max_new_tokens": stage.rollout.max_new_tokens,
                "policy_lr": trainer.policy_lr, "grad_clip": trainer.grad_clip, "ratio_clip": stage.rl.ppo_clip,
                "adam_betas": list(trainer.adam_betas), "weight_decay": trainer.weight_decay,
                "checkpointing": trainer.gradient_checkpointing, "attn_implementation": run.model.attn_implementation,
                "prompt_format": stage.rollout.prompt_format, "env": stage.env, "env_options": stage.env_options,
                "opd_sao_site": site.getsitepackages()[0]}
    (work / "trl_settings.json").write_text(json.dumps(settings))
    return settings


# ------------------------------------------------------------------ TRL side (its own venv; no opd_sao import)

def trl_worker(start: Path, out: Path, tasks_file: Path, steps: int, batch: int, seed: int,
               checkpointing: bool = True, snapshots: int = 0, settings: Path | None = None,
               cpu_budget: float | None = None) -> dict:
    """TRL's GRPOTrainer on the same start, prompts and settings. The reward is ArithmeticEnv's verifier
    (ExactAnswerEnv.step: the decoded completion, stripped, equals the answer), restated here because this venv
    does not have opd-sao; the held-out score of the result is the project's own evaluation. `checkpointing`:
    GRPOConfig's `gradient_checkpointing` (TRL's default true; opd-sao's side runs without). `snapshots`,
    `cpu_budget`: see Snapshots (a callback at the end of each optimizer step, where opd-sao's after_step runs).
    `settings`: real-model mode's (real_settings): the stage's values over SETTINGS, the tasks file's prompts
    already rendered by opd-sao, and the reward the project's environment itself."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(THREADS)
    s = {**SETTINGS, "checkpointing": checkpointing, "adam_betas": (0.9, 0.999), "weight_decay": 0.0,
         "attn_implementation": "eager", **(json.loads(Path(settings).read_text()) if settings else {})}
    tok = AutoTokenizer.from_pretrained(start)
    model = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32, attn_implementation=s["attn_implementation"])
    tasks = json.loads(Path(tasks_file).read_text())
    if "env" in s:  # real-model mode: opd-sao's rendered prompt; the environment's own reward
        data = Dataset.from_list([{"prompt": t["text"], "task": json.dumps(t["task"])} for t in tasks])
        reward = environment_reward(s)
    else:
        # opd-sao's raw prompts are BOS + the text when the tokenizer has a BOS; TRL tokenizes the text as given
        bos = tok.bos_token or ""
        data = Dataset.from_list([{"prompt": bos + t["prompt"], "answer": t["answer"]} for t in tasks])

        def exact_answer(completions, answer, **_):
            return [float(c.strip() == a) for c, a in zip(completions, answer)]
        reward = exact_answer

    betas = s["adam_betas"]
    cfg = GRPOConfig(output_dir=str(out / "trl"), max_steps=steps, per_device_train_batch_size=batch,
                     num_generations=GROUP, max_completion_length=s["max_new_tokens"],
                     temperature=s["temperature"], top_p=1.0, learning_rate=s["policy_lr"],
                     lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch", adam_beta1=betas[0],
                     adam_beta2=betas[1], weight_decay=s["weight_decay"], max_grad_norm=s["grad_clip"],
                     epsilon=s["ratio_clip"], beta=0.0, num_iterations=1, seed=seed, use_cpu=True,
                     bf16=False, fp16=False, save_strategy="no", report_to="none", logging_steps=1,
                     disable_tqdm=True, dataloader_num_workers=0, gradient_checkpointing=s["checkpointing"])
    along = Snapshots(steps, snapshots, out, cpu_budget)

    def save(path: Path) -> None:
        model.save_pretrained(str(path))
        tok.save_pretrained(str(path))

    class AlongTheRun(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            along.after(state.global_step, model.state_dict)
            control.should_training_stop = control.should_training_stop or along.over_budget()

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok,
                          callbacks=[AlongTheRun()])
    cpu0, wall0 = cpu_seconds(), time.perf_counter()
    along.start(cpu0)
    trainer.train()
    cpu, wall = cpu_seconds() - cpu0 - along.saving, time.perf_counter() - wall0
    trainer.save_model(str(out / "checkpoint"))
    tok.save_pretrained(str(out / "checkpoint"))
    along.write(model, save)
    # every step's logged row (reward, its spread, KL, clip ratios, completion lengths), kept beside the row's
    # result: a run that goes wrong (a collapse) can be read afterwards, as opd-sao's metrics.jsonl can
    (out / "trl_log_history.jsonl").write_text("".join(json.dumps(row) + "\n" for row in trainer.state.log_history))
    rewards = [row["reward"] for row in trainer.state.log_history if "reward" in row]
    return {"episodes": trainer.state.global_step * batch, "cpu_s": cpu, "wall_s": wall,
            "log_history": str(out / "trl_log_history.jsonl"),
            "torch_threads": torch.get_num_threads(), "checkpoint": str(out / "checkpoint"), "snapshots": along.points,
            "reward_last_logged": rewards[-1] if rewards else None,
            "loss_type": cfg.loss_type, "scale_rewards": str(cfg.scale_rewards)}


def environment_reward(s: dict):
    """TRL's reward function for real-model mode: each completion stepped through the project's environment
    (`s["env"]` with `s["env_options"]`, the task as the dataset's `task` column), exactly as opd-sao's rollouts
    score it. The environment code comes from opd-sao's venv (`s["opd_sao_site"]`), appended after this venv's own
    packages, so TRL, torch and transformers stay this venv's."""
    import site

    site.addsitedir(s["opd_sao_site"])
    from opd_sao.envs import ENVIRONMENTS

    ENVIRONMENTS.get(s["env"])(**s["env_options"]).all_tasks("train")  # any generating before the clock, as opd-sao's

    def strict_env_reward(completions, task, **_):
        rewards = []
        for completion, task_json in zip(completions, task):
            env = ENVIRONMENTS.get(s["env"])(**s["env_options"])
            env.reset(json.loads(task_json))
            rewards.append(float(env.step(completion)[1]))
        return rewards
    return strict_env_reward


def trl_distill_worker(start: Path, out: Path, tasks_file: Path, steps: int, batch: int, seed: int,
                       teacher: Path, max_new_tokens: int = SETTINGS["max_new_tokens"]) -> dict:
    """TRL's DistillationTrainer, on-policy: the student samples completions of the same prompts at the same
    settings, the teacher scores them, and the loss is the exact forward KL over the whole vocabulary (`beta` 0)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DistillationConfig, DistillationTrainer

    torch.set_num_threads(THREADS)
    tok = AutoTokenizer.from_pretrained(start)
    load = lambda path: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    bos = tok.bos_token or ""
    data = Dataset.from_list([{"prompt": bos + t["prompt"]} for t in json.loads(Path(tasks_file).read_text())])
    betas = (0.9, 0.999)
    cfg = DistillationConfig(output_dir=str(out / "trl"), max_steps=steps, per_device_train_batch_size=batch,
                             max_completion_length=max_new_tokens, temperature=SETTINGS["temperature"],
                             top_p=1.0, beta=0.0, learning_rate=SETTINGS["policy_lr"], lr_scheduler_type="constant",
                             warmup_steps=0, optim="adamw_torch", adam_beta1=betas[0], adam_beta2=betas[1],
                             weight_decay=0.0, max_grad_norm=SETTINGS["grad_clip"], seed=seed, use_cpu=True,
                             bf16=False, fp16=False, save_strategy="no", report_to="none", logging_steps=1,
                             disable_tqdm=True, dataloader_num_workers=0)
    trainer = DistillationTrainer(model=load(start), teacher_model=load(teacher), args=cfg, train_dataset=data,
                                  processing_class=tok)
    cpu0, wall0 = cpu_seconds(), time.perf_counter()
    trainer.train()
    cpu, wall = cpu_seconds() - cpu0, time.perf_counter() - wall0
    return {"episodes": steps * batch, "cpu_s": cpu, "wall_s": wall, "torch_threads": torch.get_num_threads(),
            "peak_rss_mb": peak_mb(), "gradient_checkpointing": cfg.gradient_checkpointing,
            "loss_logged": [row["loss"] for row in trainer.state.log_history if "loss" in row][-3:]}


def trl_python(venv_root: Path) -> Path:
    """The venv's python, created and filled on first use: trl with opd-sao's torch and transformers versions."""
    import torch
    import transformers

    venv = venv_root / "trl-venv"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    check = subprocess.run([str(python), "-c", "import trl, torch, transformers; print(trl.__version__, "
                            "torch.__version__, transformers.__version__)"], capture_output=True, text=True)
    wanted = f"{TRL_VERSION} {torch.__version__} {transformers.__version__}"
    if check.stdout.strip() != wanted:
        # the same CPU wheel as ours: pip's find-links / extra index (scripts/setup.sh) resolves torch==2.13.0 to it
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"trl=={TRL_VERSION}",
                        f"torch=={torch.__version__.split('+')[0]}", f"transformers=={transformers.__version__}"],
                       check=True)
    return python


# ------------------------------------------------------------------ the OPD rows at a real vocabulary

QWEN_BATCH, QWEN_NEW_TOKENS = 16, 64  # 16 rollouts of up to 64 tokens per step


def qwen_rows(python: Path, work: Path, args) -> dict:
    """The OPD rows at vocabulary 151,936: a Qwen2 student of hidden size 32 on the real Qwen2.5 tokenizer and a
    perturbed copy as its teacher (`opd_step.build_models`), the same prompts; opd-sao top_k 16 and full, and TRL's
    DistillationTrainer (its exact loss holds [B, T, V] logits of both models)."""
    import opd_step

    student = opd_step.build_models(151_936, work)
    common = dict(start=student, steps=args.qwen_steps, batch=QWEN_BATCH, seed=args.seed, teacher=work / "teacher",
                  max_new_tokens=QWEN_NEW_TOKENS)
    rows = {granularity: run_worker(Path(sys.executable), "opd-sao", algo="opd", out=work / granularity,
                                    granularity=granularity, overlap="false", **common)
            for granularity in ("top_k", "full")}
    rows["trl_distillation"] = run_worker(python, "trl-distill", out=work / "trl", tasks=work.parent / "train_tasks.json",
                                          **common)
    for result in rows.values():
        result.pop("checkpoint", None)
        result["cpu_s_per_step"] = result["cpu_s"] / args.qwen_steps
    return rows


# ------------------------------------------------------------------ driver

def repeat_ratios(runs: dict, opd: dict) -> dict:
    """One repeat's ratios to TRL: episodes per CPU-second (without and with the gate's two checks), OPD CPU; the
    rows in turns (engine.overlap false, judged) and, suffixed `_overlap`, at the default."""
    trl = runs["trl_grpo"]["episodes_per_cpu_s"]
    out = {}
    for mode in ("", "_overlap"):
        with_gate = {name: runs[name + mode]["episodes"] / (runs[name + mode]["cpu_s"] + runs[name + mode]["gate_cpu_s"])
                     / trl for name in ("opd_sao_grpo", "opd_sao_sao")}
        out.update({f"grpo_vs_trl{mode}": runs["opd_sao_grpo" + mode]["episodes_per_cpu_s"] / trl,
                    f"sao_vs_trl{mode}": runs["opd_sao_sao" + mode]["episodes_per_cpu_s"] / trl,
                    f"grpo_vs_trl_gate_included{mode}": with_gate["opd_sao_grpo"],
                    f"sao_vs_trl_gate_included{mode}": with_gate["opd_sao_sao"],
                    f"opd_top_k_cpu_vs_trl_distillation{mode}": opd["opd_sao_opd_top_k" + mode]["cpu_s"]
                    / opd["trl_distillation"]["cpu_s"]})
    out["sao_minibatches_vs_trl"] = runs["opd_sao_sao_minibatches"]["episodes_per_cpu_s"] / trl
    bare = runs["trl_grpo_no_checkpointing"]["episodes_per_cpu_s"]  # not judged: TRL as a user tuning it runs it
    out.update({f"{name}_vs_trl_no_checkpointing": runs[row]["episodes_per_cpu_s"] / bare for name, row in
                (("grpo", "opd_sao_grpo"), ("sao", "opd_sao_sao"), ("sao_minibatches", "opd_sao_sao_minibatches"))})
    return out


CURVES = ("opd_sao_sao", "opd_sao_sao_minibatches", "opd_sao_grpo", "trl_grpo")  # the judged RL rows
SAO_VARIANT = "opd_sao_sao_top"  # real-model mode's SAO with trainer.critic_trained_layers N: opd_sao_sao_top<N>


def held_out_curves(repeats: list[tuple[dict, dict]], batch: int) -> dict:
    """Each judged row's held-out accuracy along the run: at every snapshot and at the end, the mean over the
    repeats (as the final accuracy is) at the median CPU-seconds; real-model mode's rows only there, each point
    with its evaluation's standard error (the largest of the repeats')."""
    curves = {}
    for name in (name for name in repeats[0][0] if name in CURVES or name.startswith(SAO_VARIANT)):
        along = [rl[name]["snapshots"] + [{"step": rl[name]["episodes"] // batch, **rl[name]}] for rl, _ in repeats]
        curves[name] = [{"episodes": points[0]["step"] * batch,
                         "cpu_s": statistics.median(p["cpu_s"] for p in points),
                         "held_out": statistics.fmean(p["held_out"] for p in points),
                         **({"held_out_stderr": max(p["held_out_stderr"] or 0.0 for p in points)}
                            if "held_out_stderr" in points[0] else {}),
                         **({"held_out_per_task": [statistics.fmean(t) for t in zip(
                             *(p["held_out_per_task"] for p in points))]}
                            if all("held_out_per_task" in p for p in points) else {})} for points in zip(*along)]
    return curves


def accuracy_at(points: list[dict], cpu_s: float, start_held_out, key: str = "held_out"):
    """A curve's held-out accuracy at `cpu_s`, by linear interpolation from the start (0 CPU-s, the start's
    accuracy); its final accuracy past its end. With `key` held_out_per_task, each item's (lists)."""
    def between(a, b, share: float):
        return [x + share * (y - x) for x, y in zip(a, b)] if isinstance(a, list) else a + share * (b - a)

    previous = {"cpu_s": 0.0, key: start_held_out}
    for point in points:
        if cpu_s <= point["cpu_s"]:
            return between(previous[key], point[key], (cpu_s - previous["cpu_s"]) / (point["cpu_s"] - previous["cpu_s"]))
        previous = point
    return points[-1][key]


def at_equal_cpu(curves: dict, start_held_out: float) -> dict:
    """The curves compared at equal cost, TRL GRPO's the reference (reported, not judged):

    * `held_out_at_trl_cpu_s`: each row's held-out accuracy at each of TRL's points' CPU-seconds, read off its curve
      by linear interpolation from the start (0 CPU-s, the start's accuracy), its final accuracy past its end;
    * `to_trl_final_vs_trl`: TRL's CPU-seconds to its first point at or above its own final accuracy over the
      row's to its first such point (None if it never gets there): > 1, the row gets where TRL ends for less."""
    def first_at(points: list[dict], target: float) -> float | None:
        return next((p["cpu_s"] for p in points if p["held_out"] >= target), None)

    trl = curves["trl_grpo"]
    trl_cpu = first_at(trl, trl[-1]["held_out"])
    out = {"trl_cpu_s": [p["cpu_s"] for p in trl], "trl_held_out": [p["held_out"] for p in trl],
           "held_out_at_trl_cpu_s": {}, "to_trl_final_vs_trl": {}}
    for name in (name for name in curves if name != "trl_grpo"):
        out["held_out_at_trl_cpu_s"][name] = [accuracy_at(curves[name], p["cpu_s"], start_held_out) for p in trl]
        reached = first_at(curves[name], trl[-1]["held_out"])
        out["to_trl_final_vs_trl"][name] = None if reached is None else trl_cpu / reached
    return out


def sao_at_equal_cpu(curves: dict, start: dict, sao_row: str = "opd_sao_sao") -> dict:
    """Real-model mode's judgement of SAO row `sao_row`: at each point of every row that is not SAO within its
    CPU-seconds, and at that row's final point (past SAO's end: SAO's final accuracy, got for less CPU), SAO's
    held-out accuracy there (its curve interpolated) against the row's own; `at_or_above` when SAO's is never
    below. Where every point has its items' scores, `lead_se`: the standard error of SAO's lead (SAO minus the
    row) over the items, paired (both evaluated on the same items and keyed draws)."""
    sao = curves[sao_row]
    paired = "held_out_per_task" in start and all("held_out_per_task" in p for c in curves.values() for p in c)
    out = {}
    for name in (name for name in curves if not name.startswith("opd_sao_sao")):
        points = []
        for p in (p for p in curves[name] if p["cpu_s"] <= sao[-1]["cpu_s"] or p is curves[name][-1]):
            point = {"cpu_s": p["cpu_s"], name: p["held_out"], "sao": accuracy_at(sao, p["cpu_s"], start["held_out"])}
            if paired:
                leads = [a - b for a, b in zip(accuracy_at(sao, p["cpu_s"], start["held_out_per_task"],
                                                           "held_out_per_task"), p["held_out_per_task"])]
                point["lead_se"] = statistics.stdev(leads) / len(leads) ** 0.5
            points.append(point)
        out[name] = {"points": points, "at_or_above": bool(points) and all(p["sao"] >= p[name] for p in points)}
    return out


LABELS = {"opd_sao_sao": "opd-sao SAO", "opd_sao_sao_minibatches": "opd-sao SAO, critic mini-batches",
          "opd_sao_grpo": "opd-sao GRPO", "trl_grpo": f"TRL {TRL_VERSION} GRPOTrainer"}


def plot_curves(curves: dict, start: dict, path: Path, title: str) -> None:
    """Held-out accuracy against training CPU-seconds, every row from the start (0 CPU-s), +-1 standard error
    where the evaluation gives one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in curves.items():
        points = [{"cpu_s": 0.0, **start}] + points
        ax.errorbar([p["cpu_s"] for p in points], [p["held_out"] for p in points], marker="o", capsize=3,
                    yerr=[p.get("held_out_stderr") or 0.0 for p in points], label=LABELS.get(name, name))
    ax.set_xlabel("training CPU-seconds (user + system, every thread)")
    ax.set_ylabel("held-out accuracy")
    ax.set_title(title, fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


PIN_CORE: int | None = None  # --pin-core: every worker, either side, on this one core


def run_worker(python: Path, kind: str, **kw) -> dict:
    args = [str(python), __file__, "--worker", kind, f"--threads={THREADS}"] + [f"--{k.replace('_', '-')}={v}"
                                                                               for k, v in kw.items()]
    pin = None if PIN_CORE is None else (lambda: os.sched_setaffinity(0, {PIN_CORE}))
    proc = subprocess.run(args, env=thread_env(), capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], preexec_fn=pin)
    if proc.returncode:
        sys.exit(f"{kind} worker failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_repeat(python: Path, work: Path, repeat: int, common: dict, distill: dict, opd_steps: int,
               snapshots: int) -> tuple[dict, dict]:
    """One repeat's runs: every opd-sao row in turns (engine.overlap false) and at the default, then TRL's. The
    judged rows (CURVES) also save `snapshots` - 1 policies along the run."""
    rl, opd = {}, {}
    for mode, overlap in (("", "false"), ("_overlap", "true")):  # turns (judged), then the default
        along = {} if mode else {"snapshots": snapshots}
        for algo in ("sao", "grpo"):
            rl[f"opd_sao_{algo}{mode}"] = run_worker(Path(sys.executable), "opd-sao", algo=algo, overlap=overlap,
                                                     out=work / f"{algo}{mode}{repeat}", **along, **common)
        if not mode:  # SAO with its K critic updates on K mini-batches (one pass over the batch), in turns only
            rl["opd_sao_sao_minibatches"] = run_worker(Path(sys.executable), "opd-sao", algo="sao", overlap=overlap,
                                                       critic_minibatches="true", out=work / f"sao_mb{repeat}",
                                                       **along, **common)
        opd[f"opd_sao_opd_top_k{mode}"] = run_worker(Path(sys.executable), "opd-sao", algo="opd", overlap=overlap,
                                                     out=work / f"opd{mode}{repeat}", **distill)
    rl["trl_grpo"] = run_worker(python, "trl", out=work / f"trl{repeat}", tasks=work / "train_tasks.json",
                                snapshots=snapshots, **common)
    rl["trl_grpo_no_checkpointing"] = run_worker(python, "trl", out=work / f"trl_bare{repeat}", checkpointing="false",
                                                 tasks=work / "train_tasks.json", **common)
    opd["trl_distillation"] = run_worker(python, "trl-distill", out=work / f"trl-distill{repeat}",
                                         tasks=work / "train_tasks.json", **distill)
    for result in (*rl.values(), *opd.values()):
        result["episodes_per_cpu_s"] = result["episodes"] / result["cpu_s"]
    for result in opd.values():
        result.pop("checkpoint", None)
        result["cpu_s_per_step"] = result["cpu_s"] / opd_steps
    return rl, opd


def earlier_rows(directory: Path, expected: dict) -> tuple[dict, dict]:
    """`--rows-from DIR`: the evaluated rows and start score of DIR/result.json, a real-model run with the same
    settings (`expected`: model, config, env, threads, budget, batch, evaluation, one repeat); exits naming any
    that differ."""
    earlier = json.loads((directory / "result.json").read_text())
    differs = [key for key, value in expected.items() if earlier.get(key) != value]
    if differs or expected["repeats"] != 1:
        sys.exit(f"--rows-from {directory}: its {', '.join(differs) or 'repeats'} differ from this run's (one "
                 "repeat, the same model, config, env, threads, budget, batch and evaluation)")
    return earlier["runs"], earlier["start_held_out"]


SAME_ACROSS_SEEDS = ("model", "config", "env", "torch_threads", "steps_cap", "cpu_budget_s", "batch", "eval")


def combine_main(args, parser: argparse.ArgumentParser) -> None:
    """`--combine DIR...`: real-model runs that differ only in `--seed` (each an --out-dir) pooled. Each row's curve
    is the seeds' mean point by point (the k-th snapshot of every seed: mean CPU-s, mean held-out, the standard
    error of that mean from the evaluations' own errors, sqrt(sum se^2) / n); every SAO row is judged on the pooled
    curves as one run's are, and, at each of the other row's points, SAO's lead (interpolated SAO minus the row)
    is given per seed with its mean, from two seeds on the standard error of that mean over the seeds, and where
    the runs kept their items' scores the paired standard error of the mean from the evaluations alone."""
    if args.out_dir is None:
        parser.error("--combine needs --out-dir")
    dirs, out_dir = args.combine, args.out_dir
    results = [json.loads((d / "result.json").read_text()) for d in dirs]
    differs = [k for k in SAME_ACROSS_SEEDS if any(r.get(k) != results[0].get(k) for r in results)]
    if differs or any(r.get("mode") != "real_model" for r in results):
        sys.exit(f"--combine: the runs' {', '.join(differs) or 'mode'} differ (real-model runs alike but their seed)")
    names = [n for n in results[0]["held_out_curves"] if all(n in r["held_out_curves"] for r in results)]
    for name in (name for name in names if name.startswith(SAO_VARIANT)):
        LABELS[name] = f"opd-sao SAO, critic trains its last {name.removeprefix(SAO_VARIANT)} layers"
    n = len(results)

    def pooled(points: list[dict]) -> dict:
        return {"cpu_s": statistics.fmean(p["cpu_s"] for p in points),
                "held_out": statistics.fmean(p["held_out"] for p in points),
                "held_out_stderr": sum((p.get("held_out_stderr") or 0.0) ** 2 for p in points) ** 0.5 / n}

    curves = {name: [pooled(points) for points in zip(*(r["held_out_curves"][name] for r in results))]
              for name in names}
    start = pooled([{"cpu_s": 0.0, **r["start_held_out"]} for r in results])
    del start["cpu_s"]
    judged, leads = {}, {}
    for sao in (name for name in names if name.startswith("opd_sao_sao")):
        judged[sao] = sao_at_equal_cpu(curves, start, sao)
        for other in judged[sao]:
            each = [sao_at_equal_cpu(r["held_out_curves"], r["start_held_out"], sao)[other]["points"]
                    for r in results]
            leads[f"{sao} - {other}"] = [{
                "each_seed": [round(p["sao"] - p[other], 4) for p in points],
                "mean": statistics.fmean(p["sao"] - p[other] for p in points),
                "se_over_seeds": statistics.stdev(p["sao"] - p[other] for p in points) / n ** 0.5 if n > 1 else None,
                "se_paired": sum(p["lead_se"] ** 2 for p in points) ** 0.5 / n  # the evaluations' noise alone
                if all("lead_se" in p for p in points) else None} for points in zip(*each)]
    out_dir.mkdir(parents=True, exist_ok=True)
    plot = out_dir / "vs_trl.png"
    plot_curves(curves, start, plot, f"{Path(results[0]['model']).name} on {results[0]['env']}: mean of {n} seeds "
                f"({', '.join(d.name for d in dirs)})\nheld-out +-1 SE of the mean (evaluations' own errors)")
    print(f"held-out along the run, mean of {n} seeds (CPU-s accuracy +- SE), from {start['held_out']:.3f}:")
    for name, points in curves.items():
        print(f"  {name:<18} " + ", ".join(f"{p['cpu_s']:.0f} {p['held_out']:.3f} +- {p['held_out_stderr']:.3f}"
                                           for p in points))
    for pair, points in leads.items():
        print(f"{pair} at its points: " + ", ".join(
            f"{p['mean']:+.3f}" + (f" +- {p['se_over_seeds']:.3f}" if p["se_over_seeds"] is not None else "")
            + (f" (paired {p['se_paired']:.3f})" if p["se_paired"] is not None else "")
            + f" [{' / '.join(f'{x:+.3f}' for x in p['each_seed'])}]" for p in points))
    for sao, judgements in judged.items():
        print(f"{sao} on the pooled curves, at or above: " + ", ".join(
            f"{name} {j['at_or_above']}" for name, j in judgements.items()))
    result = {"benchmark": "vs_trl", "mode": "real_model_seeds", "runs": [str(d) for d in dirs], "seeds": n,
              **{k: results[0][k] for k in SAME_ACROSS_SEEDS}, "start_held_out": start, "held_out_curves": curves,
              "judged_on_pooled_curves": judged, "sao_lead_at_equal_cpu": leads, "plot": str(plot),
              "at_or_above_each_seed": {d.name: {k: v for k, v in r["must_show"].items() if "at_or_above" in k}
                                        for d, r in zip(dirs, results)}}
    (out_dir / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


def real_main(args, parser: argparse.ArgumentParser) -> None:
    """Real-model mode (the module's docstring): SAO, GRPO and TRL GRPO from `args.model`, evaluated alike along the
    run; a table, the plot, <out-dir>/result.json and the JSON line."""
    import torch
    import transformers

    from opd_sao.config import load_yaml

    global THREADS
    missing = [flag for flag, value in (("--config", args.config), ("--env", args.env), ("--out-dir", args.out_dir))
               if value is None]
    if missing:
        parser.error(f"--model (real-model mode) needs {', '.join(missing)}")
    if args.batch % GROUP:
        parser.error(f"--batch must be a multiple of GRPO's group of {GROUP} (got {args.batch})")
    THREADS = args.threads or load_yaml(args.config.read_text(), str(args.config)).get("torch_threads") or 1
    args.venv.mkdir(parents=True, exist_ok=True)
    python = trl_python(args.venv)
    work = args.out_dir
    work.mkdir(parents=True, exist_ok=True)
    real = {"config": str(args.config), "env": args.env, "prompt_format": args.prompt_format,
            "max_new_tokens": args.max_new_tokens, "eval_tasks": args.eval_tasks, "eval_greedy": args.eval_greedy,
            "eval_samples": args.eval_samples}
    (work / "real.json").write_text(json.dumps(real))
    settings = real_trl_inputs(real, args.model, args.seed, work)
    common = dict(start=args.model, steps=args.steps, batch=args.batch, snapshots=args.snapshots,
                  **({"cpu_budget": args.cpu_budget} if args.cpu_budget else {}))
    opd_sao_python = Path(sys.executable)
    rows = {name: (lambda out, seed, algo=algo: run_worker(opd_sao_python, "opd-sao", algo=algo, out=out,
                                                            real=work / "real.json", seed=seed, **common))
            for name, algo in (("opd_sao_sao", "sao"), ("opd_sao_grpo", "grpo"))}
    rows["trl_grpo"] = lambda out, seed: run_worker(python, "trl", out=out, tasks=work / "train_tasks.json",
                                                    settings=work / "trl_settings.json", seed=seed, **common)
    variant = f"{SAO_VARIANT}{args.critic_trained_layers}" if args.critic_trained_layers else None
    if variant:  # SAO whose critic trains its last N layers only
        (work / "real_variant.json").write_text(json.dumps({**real, "trainer": {
            "critic_trained_layers": args.critic_trained_layers}}))
        rows[variant] = lambda out, seed: run_worker(opd_sao_python, "opd-sao", algo="sao", out=out, seed=seed,
                                                     real=work / "real_variant.json", **common)
        LABELS[variant] = f"opd-sao SAO, critic trains its last {args.critic_trained_layers} layers"
    earlier, start = {}, None
    if args.rows_from:
        earlier, start = earlier_rows(args.rows_from, {
            "model": str(args.model), "config": str(args.config), "env": args.env, "torch_threads": THREADS,
            "steps_cap": args.steps, "cpu_budget_s": args.cpu_budget, "batch": args.batch, "eval": real,
            "repeats": max(1, args.repeats)})
    repeats = []
    for repeat in range(max(1, args.repeats)):  # interleaved: a slow spell hits every side
        seed = args.seed + repeat
        rl = {name: run(work / f"{name.removeprefix('opd_sao_').removesuffix('_grpo') or name}{repeat}", seed)
              for name, run in rows.items() if name not in earlier}
        repeats.append((rl, {}))
    for rl, _ in repeats:
        for result in rl.values():
            result["episodes_per_cpu_s"] = result["episodes"] / result["cpu_s"]
            result.update(real_held_out(Path(result.pop("checkpoint")), real, args.seed))
            for point in result["snapshots"]:
                point.update(real_held_out(Path(point.pop("checkpoint")), real, args.seed))
    repeats[0][0].update(earlier)  # --rows-from: evaluated there (one repeat)
    start = start or real_held_out(args.model, real, args.seed)
    curves = held_out_curves(repeats, args.batch)
    judged = sao_at_equal_cpu(curves, start)
    judged_variant = sao_at_equal_cpu(curves, start, variant) if variant else None
    runs = repeats[0][0]
    for name, result in runs.items():
        result["held_out_each_repeat"] = [rl[name]["held_out"] for rl, _ in repeats]
        result["held_out"] = statistics.fmean(result["held_out_each_repeat"])
    trl = statistics.median(rl["trl_grpo"]["episodes_per_cpu_s"] for rl, _ in repeats)
    ratios = {f"{name.removeprefix('opd_sao_')}_vs_trl": statistics.median(
        rl[name]["episodes_per_cpu_s"] for rl, _ in repeats) / trl for name in runs if name.startswith("opd_sao_")}
    plot = work / "vs_trl.png"
    plot_curves(curves, start, plot, f"{args.model.name} on {args.env}: batch {args.batch}, {THREADS} thread(s)\n"
                f"held-out {start['held_out_n']} items, " + ("greedy" if args.eval_greedy else
                                                             f"{args.eval_samples} samples each"))
    print(f"{'run':<16} {'episodes':>8} {'CPU-s':>8} {'eps/CPU-s':>10} {'held-out':>9} {'SE':>6}")
    for name, r in runs.items():
        print(f"{name:<16} {r['episodes']:>8} {r['cpu_s']:>8.1f} {r['episodes_per_cpu_s']:>10.3f} {r['held_out']:>9.3f}"
              f" {r['held_out_stderr'] or 0:>6.3f}")
    print(f"held-out along the run (episodes: CPU-s accuracy +- SE), from the start's {start['held_out']:.3f} +- "
          f"{start['held_out_stderr'] or 0:.3f} over {start['held_out_n']} items:")
    for name, points in curves.items():
        print(f"  {name:<14} " + ", ".join(f"{p['episodes']}: {p['cpu_s']:.0f} {p['held_out']:.3f} +- "
                                           f"{p['held_out_stderr'] or 0:.3f}" for p in points))
    for sao, judgements in (("opd_sao_sao", judged), (variant, judged_variant or {})):
        for name, judgement in judgements.items():
            print(f"{sao} at {name}'s points (CPU-s: {name} / SAO, paired SE of the lead): " + ", ".join(
                f"{p['cpu_s']:.0f}: {p[name]:.3f} / {p['sao']:.3f}"
                + (f" ({p['lead_se']:.3f})" if "lead_se" in p else "") for p in judgement["points"])
                + f"; at or above: {judgement['at_or_above']}")
    result = {
        "benchmark": "vs_trl", "mode": "real_model", "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU "
        f"only, load average {os.getloadavg()[0]:.1f}", "versions": {"trl": TRL_VERSION, "torch": torch.__version__,
                                                                   "transformers": transformers.__version__},
        "model": str(args.model), "config": str(args.config), "env": args.env, "seed": args.seed,
        "torch_threads": THREADS, "steps_cap": args.steps, "cpu_budget_s": args.cpu_budget, "batch": args.batch, "group_size_grpo": GROUP,
        "settings": {k: v for k, v in settings.items() if k != "opd_sao_site"}, "eval": real, "start_held_out": start,
        "runs": runs, "repeats": len(repeats), "ratios": ratios, "held_out_curves": curves,
        "sao_at_equal_cpu": judged, **({f"{variant}_at_equal_cpu": judged_variant} if variant else {}),
        "plot": str(plot),
        "must_show": {"sao_at_or_above_opd_sao_grpo_at_equal_cpu": judged["opd_sao_grpo"]["at_or_above"],
                      "sao_at_or_above_trl_grpo_at_equal_cpu": judged["trl_grpo"]["at_or_above"],
                      "held_out_items_at_least_200": start["held_out_n"] >= 200,
                      **({f"{variant}_at_or_above_both_at_equal_cpu": all(
                          j["at_or_above"] for j in judged_variant.values())} if variant else {})}}
    (work / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


def worker(args) -> None:
    """One run (`--worker KIND`, started by run_worker); its result as the last line."""
    args.out.mkdir(parents=True, exist_ok=True)
    max_new_tokens = args.max_new_tokens or SETTINGS["max_new_tokens"]
    if args.worker == "trl":
        result = trl_worker(args.start, args.out, args.tasks, args.steps, args.batch, args.seed,
                            args.checkpointing == "true", args.snapshots or 0, args.settings, args.cpu_budget)
    elif args.worker == "trl-distill":
        result = trl_distill_worker(args.start, args.out, args.tasks, args.steps, args.batch, args.seed,
                                    args.teacher, max_new_tokens)
    else:
        result = opd_sao_worker(args.start, args.out, args.algo, args.steps, args.batch, args.seed, args.teacher,
                                args.granularity, max_new_tokens, args.overlap == "true",
                                args.critic_minibatches == "true", args.snapshots or 0,
                                json.loads(args.real.read_text()) if args.real else None, args.cpu_budget)
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few steps of each run, a short warm start")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--sft-steps", type=int, default=900,
                        help="SFT steps of the shared start (900: held-out about 0.5, room for RL to show; at 300 "
                             "every run ended near 0.16 and the accuracies said nothing)")
    parser.add_argument("--eval-samples", type=int, default=8)
    parser.add_argument("--pin-core", type=int, default=None,
                        help="run every worker (opd-sao's and TRL's) on this one core: opd-sao's rollout and trainer "
                             "threads then take turns instead of running at once")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the RL and vocabulary-384 OPD rows this many times, interleaved, and judge the "
                             "median ratios (one run's ratio moves by up to a quarter on this machine)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--venv", type=Path, default=Path(tempfile.gettempdir()) / "opd-sao-vs-trl",
                        help="where trl-venv is made (kept for later runs)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--start", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--algo", help=argparse.SUPPRESS)
    parser.add_argument("--tasks", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--teacher", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--opd-steps", type=int, default=60, help="steps of the OPD rows at vocabulary 384")
    parser.add_argument("--qwen-steps", type=int, default=6,
                        help="steps of the OPD rows at vocabulary 151,936 (0: skip them)")
    parser.add_argument("--granularity", default="top_k", help=argparse.SUPPRESS)
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help=f"real-model mode: over the stage's rollout.max_new_tokens (tiny: {SETTINGS['max_new_tokens']})")
    parser.add_argument("--overlap", choices=("true", "false"), default="true", help=argparse.SUPPRESS)
    parser.add_argument("--critic-minibatches", choices=("true", "false"), default="false", help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing", choices=("true", "false"), default="true", help=argparse.SUPPRESS)
    parser.add_argument("--snapshots", type=int, default=None,
                        help="the judged RL rows' held-out accuracy also after each 1/N of their steps (default 4; "
                             "1: at the end only)")
    real = parser.add_argument_group("real-model mode (--model; the module's docstring)")
    real.add_argument("--model", type=Path, help="the start: a model directory (e.g. a stage's sft_checkpoint)")
    real.add_argument("--config", type=Path, help="the run config whose stage trains --env (its settings)")
    real.add_argument("--env", help="that stage's env, e.g. reasoning_gym:basic_arithmetic")
    real.add_argument("--prompt-format", choices=("raw", "chat"), help="over the config's (default: as resolved)")
    real.add_argument("--threads", type=int, help="torch threads of every worker, either side (default: the "
                                                  "config's torch_threads; tiny mode 1)")
    real.add_argument("--cpu-budget", type=float, help="stop each row after the step where its training CPU-seconds "
                                                       "reach this (--steps stays the cap)")
    real.add_argument("--eval-tasks", type=int, default=250, help="held-out items asked for (>= 200 for the Must-show)")
    real.add_argument("--eval-greedy", action="store_true", help="held-out greedy (else --eval-samples samples "
                                                                 "per item at the rollout temperature)")
    real.add_argument("--out-dir", type=Path, help="kept: checkpoints, vs_trl.png, result.json")
    real.add_argument("--critic-trained-layers", type=int, help="also run SAO whose critic trains only its last N "
                                                                "layers (row opd_sao_sao_top<N>), judged alike")
    real.add_argument("--rows-from", type=Path, help="take the rows an earlier run (its --out-dir, one repeat, the "
                                                     "same settings) has instead of running them again")
    real.add_argument("--combine", type=Path, nargs="+", metavar="DIR",
                      help="pool real-model runs that differ only in --seed (their --out-dirs) into --out-dir: mean "
                           "curves, SAO judged on them and its lead per seed; runs nothing")
    parser.add_argument("--real", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--settings", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    global PIN_CORE, THREADS
    THREADS = args.threads or 1
    if args.worker:
        return worker(args)
    PIN_CORE = args.pin_core
    args.snapshots = 4 if args.snapshots is None else args.snapshots
    if args.quick:
        args.steps, args.batch, args.sft_steps, args.eval_samples, args.opd_steps, args.qwen_steps = 6, 32, 60, 1, 4, 0
    if args.model or args.combine:
        return (combine_main if args.combine else real_main)(args, parser)
    import torch
    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    args.venv.mkdir(parents=True, exist_ok=True)
    python = trl_python(args.venv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        start = prepare(work, args.sft_steps, args.seed)
        common = dict(start=start, steps=args.steps, batch=args.batch, seed=args.seed)
        distill = dict(common, steps=args.opd_steps, teacher=work / "teacher")
        repeats = [run_repeat(python, work, repeat, {**common, "seed": args.seed + repeat},
                              {**distill, "seed": args.seed + repeat}, args.opd_steps, args.snapshots)
                   for repeat in range(max(1, args.repeats))]  # interleaved: a slow spell hits both sides
        for rl, _ in repeats:  # every repeat's models, each evaluated alike
            for result in rl.values():
                result["held_out"] = held_out(Path(result.pop("checkpoint")), args.eval_samples, args.seed)
                for point in result.get("snapshots", []):
                    point["held_out"] = held_out(Path(point.pop("checkpoint")), args.eval_samples, args.seed)
        curves = held_out_curves(repeats, args.batch)
        start_held_out = held_out(start, args.eval_samples, args.seed)
        equal_cpu = at_equal_cpu(curves, start_held_out)
        runs, opd = repeats[0]  # the first repeat's rows, with the held-out accuracy the repeats' mean
        for name, result in runs.items():
            result["held_out_each_repeat"] = [rl[name]["held_out"] for rl, _ in repeats]
            result["held_out"] = statistics.fmean(result["held_out_each_repeat"])
        qwen = qwen_rows(python, work / "qwen", args) if args.qwen_steps else {}
    each = [repeat_ratios(rl, distilled) for rl, distilled in repeats]
    ratios = {name: statistics.median(r[name] for r in each) for name in each[0]}
    if qwen:
        ratios.update({"top_k_cpu_vs_trl_at_151936": qwen["top_k"]["cpu_s"] / qwen["trl_distillation"]["cpu_s"],
                       "top_k_peak_rss_vs_trl_at_151936": qwen["top_k"]["peak_rss_mb"]
                       / qwen["trl_distillation"]["peak_rss_mb"]})
    print(f"{'run':<26} {'episodes':>8} {'CPU-s':>8} {'eps/CPU-s':>10} {'held-out':>9}  (each repeat's)")
    for name, r in runs.items():
        each_held = ", ".join(f"{x:.3f}" for x in r["held_out_each_repeat"])
        print(f"{name:<26} {r['episodes']:>8} {r['cpu_s']:>8.1f} {r['episodes_per_cpu_s']:>10.1f} {r['held_out']:>9.3f}"
              f"  ({each_held})")
    for name, r in [*opd.items(), *((f"{k}@151936", v) for k, v in qwen.items())]:
        print(f"{name:<26} {r['episodes']:>8} {r['cpu_s']:>8.1f} {r['cpu_s_per_step']:>10.3f} CPU-s/step, "
              f"peak RSS {r['peak_rss_mb']:.0f} MB")
    for i, r in enumerate(each):
        print(f"repeat {i}: GRPO {r['grpo_vs_trl']:.2f}x, SAO {r['sao_vs_trl']:.3f}x (critic mini-batches "
              f"{r['sao_minibatches_vs_trl']:.3f}x), OPD top_k CPU / TRL's "
              f"{r['opd_top_k_cpu_vs_trl_distillation']:.2f}; overlapping: GRPO {r['grpo_vs_trl_overlap']:.2f}x, "
              f"SAO {r['sao_vs_trl_overlap']:.2f}x, OPD {r['opd_top_k_cpu_vs_trl_distillation_overlap']:.2f}; against "
              f"TRL without checkpointing: GRPO {r['grpo_vs_trl_no_checkpointing']:.2f}x, SAO "
              f"{r['sao_vs_trl_no_checkpointing']:.2f}x ({r['sao_minibatches_vs_trl_no_checkpointing']:.2f}x)")
    print(f"ratios to TRL GRPO (median of {len(each)} repeat(s); episodes per CPU-second; engine.overlap false): "
          f"opd-sao GRPO {ratios['grpo_vs_trl']:.2f}x (must >= 1.3), "
          f"SAO {ratios['sao_vs_trl']:.3f}x (must >= 1.0), SAO with critic mini-batches "
          f"{ratios['sao_minibatches_vs_trl']:.3f}x; with the gate's two checks: GRPO "
          f"{ratios['grpo_vs_trl_gate_included']:.2f}x, SAO {ratios['sao_vs_trl_gate_included']:.2f}x; OPD top_k CPU / "
          f"TRL DistillationTrainer's {ratios['opd_top_k_cpu_vs_trl_distillation']:.2f} (must <= 1); at the default "
          f"engine.overlap true: GRPO {ratios['grpo_vs_trl_overlap']:.2f}x, SAO {ratios['sao_vs_trl_overlap']:.2f}x, "
          f"OPD {ratios['opd_top_k_cpu_vs_trl_distillation_overlap']:.2f}; against TRL GRPO with gradient_checkpointing "
          f"false (not judged): GRPO {ratios['grpo_vs_trl_no_checkpointing']:.2f}x, SAO "
          f"{ratios['sao_vs_trl_no_checkpointing']:.2f}x, with critic mini-batches "
          f"{ratios['sao_minibatches_vs_trl_no_checkpointing']:.2f}x")
    if qwen:
        print(f"at 151,936: top_k CPU / TRL's {ratios['top_k_cpu_vs_trl_at_151936']:.2f} (must <= 0.8), peak RSS "
              f"{ratios['top_k_peak_rss_vs_trl_at_151936']:.2f} (must <= 0.5); full {qwen['full']['peak_rss_mb']:.0f} MB "
              f"(must < 2048)")
    print(f"held-out along the run (mean of {len(each)} repeat(s) at the median CPU-s; episodes: CPU-s accuracy), "
          f"from the start's {start_held_out:.3f}:")
    for name, points in curves.items():
        print(f"  {name:<24} " + ", ".join(f"{p['episodes']}: {p['cpu_s']:.1f} {p['held_out']:.3f}" for p in points))
    print("held-out at TRL's CPU-s " + ", ".join(f"{c:.1f}" for c in equal_cpu["trl_cpu_s"]) + " (TRL "
          + ", ".join(f"{a:.3f}" for a in equal_cpu["trl_held_out"]) + "; not judged): " + "; ".join(
              f"{name} " + ", ".join(f"{a:.3f}" for a in accs) for name, accs in equal_cpu["held_out_at_trl_cpu_s"].items()))
    print(f"to TRL's final held-out {curves['trl_grpo'][-1]['held_out']:.3f}, TRL's CPU-s to its first point there "
          "over each row's (not judged): " + ", ".join(f"{name} " + ("never" if r is None else f"{r:.2f}x")
                                                       for name, r in equal_cpu["to_trl_final_vs_trl"].items()))
    print(json.dumps({
        "benchmark": "vs_trl", "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU only, load average "
        f"{os.getloadavg()[0]:.1f}", "versions": {"trl": TRL_VERSION, "torch": torch.__version__,
                                                 "transformers": transformers.__version__},
        "quick": args.quick,  # a smoke test: 6 steps' ratios and accuracies say nothing about the Must-show
        "torch_threads": 1, "pinned_core": args.pin_core, "steps": args.steps, "batch": args.batch, "group_size_grpo": GROUP, "settings": SETTINGS,
        "opd": {"steps": args.opd_steps, "top_k": OPD_TOP_K, "divergence": "forward_kl", "vocab": 384},
        "eval_samples_per_task": args.eval_samples, "runs": runs, "opd_runs": opd, "ratios": ratios,
        "start_held_out": start_held_out, "held_out_curves": curves, "at_equal_cpu": equal_cpu,
        "repeats": len(each), "ratios_each_repeat": each,
        "cpu_s_each_repeat": {name: [{**rl, **distilled}[name]["cpu_s"] for rl, distilled in repeats]
                              for name in (*repeats[0][0], *repeats[0][1])},
        "opd_runs_151936": qwen, "qwen_rows": {"steps": args.qwen_steps, "batch": QWEN_BATCH,
                                               "max_new_tokens": QWEN_NEW_TOKENS} if qwen else None,
        "must_show": {"grpo_at_least_1.3x": ratios["grpo_vs_trl"] >= 1.3, "sao_at_least_1.0x": ratios["sao_vs_trl"] >= 1.0,
                      "sao_held_out_above_grpo": runs["opd_sao_sao"]["held_out"] > runs["opd_sao_grpo"]["held_out"],
                      "sao_critic_minibatches_at_least_1.0x": ratios["sao_minibatches_vs_trl"] >= 1.0,
                      "sao_critic_minibatches_held_out_above_grpo":
                          runs["opd_sao_sao_minibatches"]["held_out"] > runs["opd_sao_grpo"]["held_out"],
                      "opd_top_k_at_384_no_more_cpu_than_trl": ratios["opd_top_k_cpu_vs_trl_distillation"] <= 1.0,
                      **({"top_k_at_151936_at_most_0.8x_trl_cpu": ratios["top_k_cpu_vs_trl_at_151936"] <= 0.8,
                          "top_k_at_151936_at_most_half_trl_memory": ratios["top_k_peak_rss_vs_trl_at_151936"] <= 0.5,
                          "full_at_151936_under_2_gb": qwen["full"]["peak_rss_mb"] < 2048} if qwen else {})}}))


if __name__ == "__main__":
    main()
