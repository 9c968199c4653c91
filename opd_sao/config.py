"""The one config schema: it mirrors the YAML, holds every default, and validates before any work starts."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Optional, Union, get_args, get_origin

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_serializer,
    model_validator,
)

from opd_sao.devices import DEVICE_PATTERN, check_device
from opd_sao.errors import UsageError
from opd_sao.gguf_header import gguf_has_chat_template, is_gguf_path
from opd_sao.registry import Registry, load_plugins

Granularity = Literal["sampled", "top_k", "top_p", "full"]
Dtype = Literal["float32", "bfloat16"]
TrainerDtype = Literal["float32", "bfloat16", "float64"]

log = logging.getLogger(__name__)


def _registered(registry: str, what: str) -> AfterValidator:
    """A name registered in `opd_sao.algorithms.<registry>` (the registries are the one list of each)."""
    def check(value: Optional[str]) -> Optional[str]:
        import opd_sao.algorithms as A

        names = getattr(A, registry)
        if value is not None and value not in names:
            raise ValueError(f"unknown {what} {value!r}; registered: {', '.join(names.names())}")
        return value

    return AfterValidator(check)


Algo = Annotated[str, _registered("PRESETS", "algo")]
Divergence = Annotated[str, _registered("DIVERGENCES", "divergence")]


class ConfigError(UsageError):
    """A user mistake in a config file or override, reported as one line."""


def _one_path_component(value: str) -> str:
    """A name that becomes a folder or file name (a stage's folder, a teacher's disk-tier copy): exactly one path
    component, so that no name reaches outside the run directory or lands in its parent folder."""
    if not value or value in (".", "..") or any(c in value for c in "/\\\0"):
        raise ValueError(f"{value!r} is not a usable name: it becomes a folder name, so it must be non-empty, not "
                         f"'.' or '..', and hold no '/', '\\' or NUL")
    return value


PathName = Annotated[str, AfterValidator(_one_path_component)]
MAX_BATCH = 2**20  # the most of anything one step or call may hold (trajectories, examples, sequences)
MAX_THREADS = 4096


def _plain_type(annotation) -> set:
    """The classes an annotation admits (Optional and Annotated unwrapped)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _plain_type(args[0])
    if origin in (Union, UnionType):
        return set().union(*(_plain_type(a) for a in args))
    return {origin or annotation}


class Strict(BaseModel):
    """Every section: unknown keys refused, and every float finite (`gt=0` alone lets `.inf` through)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        """`steps: true` is a mistake, not the number 1 (pydantic's lax mode would read it so)."""
        if isinstance(value, bool):
            kinds = _plain_type(cls.model_fields[info.field_name].annotation)
            if kinds & {int, float} and bool not in kinds and Any not in kinds:
                raise ValueError(f"a number is needed, not the boolean {str(value).lower()}")
        return value


def describe(description: str, default: Any = ..., **constraints) -> Any:
    """A documented field: every setting says what it does (`opd-sao config` prints them all)."""
    return Field(default, description=description, **constraints)


def describe_device(description: str, default: Optional[str] = None) -> Any:
    """A `device` setting: auto, cpu, cuda or cuda:N (checked against this machine by RunConfig)."""
    return describe(description, default, pattern=DEVICE_PATTERN)


def require_device(where: str, spec: Optional[str]) -> None:
    """A device this machine lacks is a config error naming the setting, found before any work."""
    try:
        check_device(spec)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


class TinyModelConfig(Strict):
    """Shape of the model the project builds itself when `model.path` is `tiny`."""

    vocab_size: int = describe("BPE vocabulary size of the tokenizer trained on the environments' corpora", 384, ge=64)
    hidden_size: int = describe("hidden width", 64, ge=8)
    intermediate_size: int = describe("MLP width", 192, ge=8)
    num_layers: int = describe("decoder layers", 2, ge=1)
    num_heads: int = describe("attention heads", 4, ge=1)
    num_kv_heads: int = describe("key/value heads (grouped-query attention when fewer than num_heads)", 2, ge=1)
    max_positions: int = describe("maximum sequence length (positions)", 1024, ge=64)

    @model_validator(mode="after")
    def _heads_fit(self) -> "TinyModelConfig":
        """The shapes transformers would refuse (or mis-build) only when the model is built, refused here."""
        if self.hidden_size % (2 * self.num_heads):
            raise ValueError(f"hidden_size {self.hidden_size} must be a multiple of 2 x num_heads {self.num_heads} "
                             f"(an even head size, as rotary embeddings need)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads {self.num_kv_heads} must divide num_heads {self.num_heads}")
        return self


class ModelConfig(Strict):
    """The base model every stage starts from."""

    path: str = describe("'tiny': build the embedded tiny model; a .gguf file: converted once (float32, as opd-sao "
                         "models import) into the run's base_model/, used as a model directory; otherwise a local "
                         "HF-format model directory, and then "
                         "the settings left unset that are the tiny model's get real-model values (trainer.policy_lr, "
                         "trainer.critic_lr, prompt_format) or a warning line each (docs/usage.md)", "tiny")
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2"] = describe(
        "transformers attention of the policy in the trainer (SFT too), the embedded engine and evaluation (the same "
        "one: the gate compares trainer and engine); sdpa and flash_attention_2 never hold the [B, heads, T, T] scores; flash_attention_2 needs "
        "CUDA and the flash_attn package. The critic runs sdpa (flash_attention_2 when chosen)", "eager")
    tiny: TinyModelConfig = describe("shape of the tiny model (path: tiny)", TinyModelConfig())


class EngineConfig(Strict):
    """The rollout engine: in-process, or SGLang-API servers."""

    kind: Literal["embedded", "http"] = describe("embedded: in-process continuous batching; http: rollout servers "
                                                 "speaking SGLang's native API (SGLang or `opd-sao serve`)", "embedded")
    urls: list[str] = describe("kind=http: the rollout servers' base URLs", [])
    weights_dir: Optional[str] = describe("kind=http: where weight syncs are written; every server must read it "
                                          "(default: a temporary directory)", None)
    workers: list[str] = describe(
        "kind=http: the rollout servers behind a router named in urls (e.g. sglang-router). Generation goes "
        "through the urls; weight syncs, weight_version checks and health checks go to these. Default: asked "
        "from each router (GET /workers)", [])
    weight_sync: str = describe(
        "kind=http: how weights reach the workers (a registered weight-sync mode, opd_sao/engines/weight_sync/). "
        "disk: an HF checkpoint under weights_dir, loaded by /update_weights_from_disk (workers read weights_dir); "
        "tensor: the tensors inside HTTP requests in SGLang's pickled format (/update_weights_from_tensor, "
        "buckets of weight_sync_bucket_mb); distributed: broadcasts from this process over a weight update "
        "group (/init_weights_update_group, /update_weights_from_distributed; NCCL on CUDA, gloo on CPU)", "disk")
    weight_sync_options: dict[str, Any] = describe(
        "kind=http: the weight-sync mode's own settings, validated by the `Options` model its class declares "
        "(a plugin mode's; the built-in modes take none) before any work", {})
    routing: str = describe(
        "kind=http: which live server each request goes to, a policy registered in opd_sao/engines/routing.py "
        "(least_loaded: the fewest estimated tokens in flight; or one added with register_routing)",
        "least_loaded")
    weight_sync_address: Optional[str] = describe(
        "weight_sync distributed: this process's address as the workers reach it (they join the group's "
        "store there, on a free port). Default: this machine's address on its route to the first worker "
        "(loopback for workers on this host); a loopback address with a worker on another host is refused", None)
    weight_sync_bucket_mb: float = describe(
        "weight_sync tensor and distributed: the most megabytes (MiB) one request or broadcast carries (a larger "
        "tensor goes alone)", 256.0, gt=0)
    weight_sync_timeout_s: float = describe(
        "weight_sync distributed: seconds to form the weight update group (every worker joined) before the "
        "run stops; one phase of three, see weight_sync_broadcast_timeout_s and weight_sync_drain_timeout_s",
        60.0, gt=0)
    weight_sync_broadcast_timeout_s: float = describe(
        "weight_sync distributed: seconds each bucket's broadcast (and the worker's answer) may take; the workers "
        "receive at once, since generation is paused first", 300.0, gt=0)
    weight_sync_drain_timeout_s: float = describe(
        "weight_sync tensor and distributed: seconds a worker may take to answer /pause_generation (mode abort: "
        "its running requests aborted, to be sent again on the new weights) before the sync fails", 120.0, gt=0)
    partial_rollouts: bool = describe(
        "kind=http, weight_sync tensor and distributed: a request the sync's pause aborts keeps the tokens it had "
        "(with their logprobs and version) and continues on the new weights from prompt + those token ids with the "
        "rest of max_new_tokens (slime's partial rollouts); its trajectory records each token's version, the "
        "staleness bound counts its oldest, and the learner reports DIS masking per token age. False: it is sent "
        "again whole and its tokens are thrown away (no trajectory mixes two versions)", False)
    api_key: Optional[str] = describe(
        "kind=http: the servers' API key (SGLang's --api-key), sent as Authorization: Bearer; default: the "
        "environment's OPD_SAO_API_KEY", None)
    admin_api_key: Optional[str] = describe(
        "kind=http: the key SGLang's admin endpoints (weight updates, /flush_cache) are sent with (its "
        "--admin-api-key); default: the environment's OPD_SAO_ADMIN_API_KEY, else api_key", None)
    max_batch: int = describe("concurrent sequences in the continuous batch", 32, ge=1, le=MAX_BATCH)
    dtype: Dtype = describe("embedded engine weights' dtype", "float32")
    overlap: bool = describe(
        "embedded: generate while the trainer computes (two threads at once: less wall time); false: the two take "
        "turns, the engine decoding only between the trainer's steps (at one torch thread per process on the tiny "
        "model, 4-20% less CPU per episode and more wall time, docs/benchmarks.md; on one accelerator, no two "
        "compute streams at once)", True)
    own_forward: Optional[bool] = describe(
        "embedded: Llama-family models (llama, mistral, qwen2, qwen3; every layer attending to the whole sequence) "
        "decode and prefill through the engine's own forward (opd_sao/model/llama_forward.py: transformers' "
        "function in fewer operations); false, or any other model: transformers' forward. Unset (auto): ours on "
        "CPU, where it is measured faster (docs/benchmarks.md), transformers' on CUDA or any other device until "
        "scripts/gpu_check.sh's `forwards` step has measured ours there", None)
    deterministic: bool = describe("score every sequence alone with the trainer's kernels (bitwise agreement; slow)",
                                   False)
    device: Optional[str] = describe_device("where the embedded engine's model and batches live (auto | cpu | cuda | "
                                            "cuda:N); default: the run's `device`")


class TrainerConfig(Strict):
    """The trainer: backend, optimizers, batch size."""

    backend: Literal["torch", "deepspeed"] = describe("torch: one process; deepspeed: ZeRO 1/2/3 over torchrun ranks",
                                                      "torch")
    policy_lr: float = describe("policy AdamW learning rate (the tiny model's; unset with a checkpoint as model.path: "
                                "1e-6, verl's actor lr and TRL's GRPOConfig default)", 1e-4, gt=0)
    critic_lr: float = describe("critic AdamW learning rate (the tiny model's; unset with a checkpoint as model.path: "
                                "1e-5, verl's critic lr)", 5e-4, gt=0)
    critic_steps: int = describe("K critic updates per policy update (TTUR, docs/design.md §2.3)", 2, ge=1)
    critic_minibatches: bool = describe(
        "the K critic updates on K mini-batches of the step's batch (every K-th trajectory), one pass over it, as "
        "verl's critic with a mini-batch of batch / K: K optimizer steps at the cost of one pass; false: each update "
        "reads the whole batch (K passes). Either way the policy's GAE reads the values after the K updates", False)
    critic_warmup_steps: int = describe("steps that train only the critic before the first policy update", 10, ge=0)
    freeze_critic_attention: bool = describe("freeze the critic's attention weights (SAO)", True)
    critic_trained_layers: Optional[int] = describe(
        "with freeze_critic_attention: train the feed-forward blocks of the last N decoder layers only (the critic's "
        "backward then stops at the first of them, and a step's later critic forwards run N layers: a cheaper "
        "critic); unset: every layer's", None, ge=1)
    grad_clip: float = describe("gradient-norm clip of policy and critic", 1.0, gt=0)
    adam_betas: tuple[float, float] = describe("policy and critic AdamW betas (torch; DeepSpeed unless its config "
                                               "names an optimizer)", (0.9, 0.999))
    weight_decay: float = describe("AdamW weight decay", 0.0, ge=0)
    train_batch_size: int = describe("trajectories per policy step", 16, ge=1, le=MAX_BATCH)
    dtype: TrainerDtype = describe("the trainer's compute dtype; bfloat16 is mixed precision: weights, gradients and "
                                   "optimizer stay float32 (torch: autocast; deepspeed: its bf16 mode), checkpoints "
                                   "are written float32 (torch) or bfloat16 (deepspeed); float64: weights, optimizer "
                                   "and compute in float64 (exactness checks)", "float32")
    micro_batch_size: Optional[int] = describe(
        "trajectories per forward/backward pass (per rank under DeepSpeed); a step's gradients are accumulated over "
        "its micro-batches and its update is the whole batch's (null: the whole batch at once)", None, ge=1, le=MAX_BATCH)
    max_tokens_per_micro_batch: Optional[int] = describe(
        "token budget of a forward/backward pass: rows x longest sequence (padding included); trajectories are "
        "packed by length to minimise padding, a longer one goes alone (null: no budget; with micro_batch_size "
        "both limits hold)", None, ge=1)
    gradient_checkpointing: bool = describe("recompute each decoder layer's activations in the backward instead of "
                                            "keeping them (policy and critic; non-reentrant)", False)
    own_forward: Optional[bool] = describe(
        "Llama-family policies and critics (llama, mistral, qwen2, qwen3; every layer attending to the whole "
        "sequence) train through opd_sao/model/llama_forward.py (transformers' function in fewer operations, exact to "
        "float rounding, gradient_checkpointing included; not under ZeRO-3); false, or any other model: transformers' "
        "forward. Unset (auto): ours on CPU, where it is measured faster (docs/benchmarks.md), transformers' on "
        "CUDA or any other device until scripts/gpu_check.sh's `forwards` step has measured ours there", None)
    lr_schedule: Literal["constant", "linear_warmup", "cosine"] = describe(
        "policy and critic learning rate over their optimizer steps: constant; linear_warmup: rising linearly to "
        "the lr over warmup_steps, then constant; cosine: that warm-up, then a cosine decay to min_lr_ratio x lr "
        "at the stage's last step (the critic's: steps x critic_steps; SFT's: its own steps). Saved and restored on "
        "resume", "constant")
    warmup_steps: int = describe("linear_warmup and cosine: optimizer steps of warm-up (the critic's count its own "
                                 "updates, critic_steps per policy step)", 0, ge=0)
    min_lr_ratio: float = describe("cosine: the floor of the decay, as a fraction of the lr", 0.0, ge=0, le=1)
    deepspeed_config: Optional[dict[str, Any]] = describe("backend=deepspeed: a DeepSpeed config dict (defaults to "
                                                          "ZeRO-2)", None)
    slowdown_s: float = describe("artificial delay per step, to force staleness in experiments", 0.0, ge=0)
    device: Optional[str] = describe_device("where the policy, critic, SFT warm starts and the learner's batches live "
                                            "(auto | cpu | cuda | cuda:N); default: the run's `device`. DeepSpeed "
                                            "uses its launcher's GPU (LOCAL_RANK), in a world of one this one")

    @model_validator(mode="after")
    def _betas_in_range(self) -> "TrainerConfig":
        if not all(0 <= b < 1 for b in self.adam_betas):
            raise ValueError(f"adam_betas must both be in [0, 1) (got {list(self.adam_betas)})")
        return self


class Overrides(Strict):
    """A stage's overrides of a run-wide section: only the settings given are kept, and written out (a run's
    config.yaml holds what the stage changed, not a copy of the run's values)."""

    @model_serializer(mode="wrap")
    def _given_only(self, handler) -> dict:
        return {key: value for key, value in handler(self).items() if key in self.model_fields_set}


def _optional(info) -> Any:
    """A field's type and constraints, with null for `not given` (an override section's field)."""
    kind = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
    return kind if type(None) in get_args(info.annotation) else Optional[kind]


# Every trainer setting, overridable per stage, each checked as the run's is (an unknown key is refused).
StageTrainerConfig = create_model(
    "StageTrainerConfig", __base__=Overrides,
    __doc__="This stage's overrides of the run's trainer settings; unset: the run's.",
    **{name: (_optional(info), describe(f"this stage's trainer.{name} (default: the run's)", None))
       for name, info in TrainerConfig.model_fields.items()})


class RolloutConfig(Strict):
    """How a stage samples: sampling parameters, asynchrony, multi-turn episodes."""

    temperature: float = describe("sampling temperature", 1.0, gt=0)
    top_p: float = describe("nucleus sampling mass (1: the whole distribution). Below 1 the support is also cut to "
                            "the 4096 most likely tokens (SGLang's joint top-k/top-p; its scheduler takes "
                            "return_sampling_mask only with top_k <= --sampling-mask-max-tokens, 4096 by default): "
                            "served, embedded and as the trainer and gate score it", 1.0, gt=0, le=1)
    max_new_tokens: int = describe("tokens per generation (per turn; the tiny model's: with a checkpoint as model.path, "
                                   "a warning names the stages that leave it unset)", 16, ge=1)
    asynchronous: bool = describe("True: generation runs ahead of training within the staleness bound; False: "
                                  "synchronous group batching (a step waits for its whole batch)", True)
    group_size: Optional[int] = describe("rollouts per prompt; default from the algorithm (1, or 8 for grouped "
                                         "algorithms)", None, ge=1, le=MAX_BATCH)
    max_staleness: int = describe("policy versions a trajectory may lag; older ones are dropped", 4, ge=0)
    sync_every: int = describe("policy steps between weight syncs to the engine", 1, ge=1)
    max_turns: int = describe("environment turns per episode", 1, ge=1)
    max_context_tokens: int = describe("an episode ends when its context reaches this length", 512, ge=16)
    truncation: Literal["error", "left", "right"] = describe(
        "a prompt with no room to answer (max_context_tokens tokens or more, or more than the model's "
        "max_position_embeddings minus max_new_tokens; verl's data.truncation): error refuses it in one line naming "
        "the task (a dataset's file and row), checked before any work where the tasks are known up front; left "
        "keeps its last tokens, right its first", "error")
    compaction: bool = describe("summarise long agent episodes and continue from the summary (rl/compaction.py)",
                                False)
    compaction_budget: int = describe("context tokens past which an episode compacts", 256, ge=16)
    compaction_instruction: str = describe("the observation that asks the model for its summary",
                                           "\n# summary of the task and attempts so far:\n")
    prompt_format: Literal["raw", "chat"] = describe(
        "raw: prompts and observations as plain text (after BOS when the tokenizer has one); chat: the tokenizer's "
        "chat template (the prompt a user turn + the generation prompt, each observation a user turn). "
        "Default: the run's prompt_format", "raw")
    system_prompt: Optional[str] = describe("chat format: the system message before the first user turn (null: the "
                                            "template's default, if any)", None)

    @model_validator(mode="after")
    def _room_for_a_summary(self) -> "RolloutConfig":
        if self.compaction and self.compaction_budget + self.max_new_tokens >= self.max_context_tokens:
            raise ValueError(f"compaction_budget {self.compaction_budget} + max_new_tokens {self.max_new_tokens} "
                             f"must stay below max_context_tokens {self.max_context_tokens}")
        return self


# What a multi-domain stage (OPD, SFT) takes per domain from the stage that trains on it, or from an OPD teacher's
# `rollout:` (stages/domains.py): the episode's shape, not its sampling.
EPISODE_FIELDS = ("max_new_tokens", "max_turns", "max_context_tokens", "truncation", "compaction", "compaction_budget",
                  "compaction_instruction", "prompt_format", "system_prompt")


# The DIS band of a stage whose kind declares none in its `defaults` (stages/base.py; the built-in RL kinds each
# declare the paper's pair for their domain, SAO section 4.1): the paper's math band, chosen here, not inherited.
DEFAULT_DIS_BOUNDS = (0.3, 5.0)


class AlgoConfig(Strict):
    """The RL algorithm of a stage (its `rl:` section): the advantage estimator and policy loss, when not the `algo`
    preset's, and every setting they read (the registered functions in `opd_sao.algorithms` get this whole)."""

    advantage: Annotated[Optional[str], _registered("ADVANTAGES", "advantage estimator")] = describe(
        "the advantage estimator, by its name in opd_sao.algorithms.ADVANTAGES (adaptive_gae, gae, grpo, "
        "running_mean, or one added with register_advantage); null: the `algo` preset's", None)
    policy_loss: Annotated[Optional[str], _registered("POLICY_LOSSES", "policy loss")] = describe(
        "the policy loss, by its name in opd_sao.algorithms.POLICY_LOSSES (dis, ppo_clip, or one added with "
        "register_policy_loss); null: the `algo` preset's", None)
    eps_low: float = describe("DIS: tokens with ratio below 1 - eps_low are masked (unset: the stage kind's "
                              "`defaults`, the paper's value for its domain: agent 0.8, reasoning, chat and opd 0.3; "
                              "a kind that declares none: this default)", DEFAULT_DIS_BOUNDS[0], ge=0, le=1)
    eps_high: float = describe("DIS: tokens with ratio above 1 + eps_high are masked (unset: the stage kind's "
                               "`defaults`: agent 3.0, reasoning, chat and opd 5.0; a kind that declares none: this "
                               "default)", DEFAULT_DIS_BOUNDS[1], ge=0)
    alpha: float = describe("length-adaptive policy lambda = 1 - 1/(alpha * l), l >= 1 action tokens (alpha >= 1 "
                            "keeps lambda in [0, 1))", 1.5, ge=1, le=1e6)
    gamma: float = describe("discount", 1.0, ge=0, le=1)
    ppo_clip: float = describe("ppo, grpo: clip range of the ratio to pi_old", 0.2, gt=0)
    ppo_lambda: float = describe("ppo: GAE lambda", 0.95, ge=0, le=1)
    update_epochs: int = describe("ppo, grpo: passes over each batch (the clip needs > 1)", 1, ge=1)
    baseline_window: int = describe("running_mean: rewards averaged for the baseline", 128, ge=1)


class CriticPretrainConfig(Strict):
    """Value pre-training (SAO section 3.3, "scaling value pre-training"): before RL, the stage's start policy
    rolls out on training tasks and the critic is fitted to those rollouts' Monte-Carlo returns, so the first
    policy steps get advantages from a critic that already knows the task instead of a zero value head."""

    rollouts: int = describe("rollouts of the start policy to fit the critic on (0: off)", 0, ge=0, le=MAX_BATCH)
    steps: int = describe("critic optimizer steps on minibatches of those rollouts", 0, ge=0)
    batch_size: Optional[int] = describe("trajectories per critic step (default: the stage's "
                                         "trainer.train_batch_size)", None, ge=1, le=MAX_BATCH)
    carry_over: bool = describe(
        "start the critic from the one the latest earlier stage with the same env trained (saved next to its "
        "checkpoint, stages/<name>/critic) instead of from the start policy's backbone; pre-training, if on, "
        "continues from it", False)

    @model_validator(mode="after")
    def _both_or_neither(self) -> "CriticPretrainConfig":
        if bool(self.rollouts) != bool(self.steps):
            raise ValueError(f"rollouts and steps must both be > 0 (value pre-training on) or both 0 (off); got "
                             f"rollouts={self.rollouts}, steps={self.steps}")
        return self


class SFTConfig(Strict):
    """A supervised warm start on the environment's reference solutions."""

    steps: int = describe("optimizer steps (0: no warm start)", 0, ge=0)
    lr: float = describe("AdamW learning rate (the tiny model's: with a checkpoint as model.path, a warning names the "
                         "stages that leave it unset)", 3e-3, gt=0)
    batch_size: int = describe("examples per step", 32, ge=1, le=MAX_BATCH)


class EvalConfig(Strict):
    """Held-out evaluation after every stage."""

    num_tasks: int = describe("eval tasks per domain", 64, ge=1, le=MAX_BATCH)
    temperature: float = describe("sampling temperature (sampled with a fixed seed, so runs compare)", 1.0, gt=0)
    samples_per_task: int = describe("episodes per task (a score's standard error is over tasks, each task's "
                                     "samples averaged first)", 1, ge=1, le=MAX_BATCH)
    greedy: bool = describe("argmax decoding (top_k 1) instead of sampling at `temperature`: one deterministic "
                            "answer per task", False)


class GateConfig(Strict):
    """The train/inference consistency gate (docs/design.md §5)."""

    enabled: bool = describe("check the stage's engine against its trainer", True)
    mean_abs_diff: float = describe("fail when the mean |logp_train - logp_rollout| exceeds this", 1e-3, gt=0)
    p99_abs_diff: float = describe("fail when the 99th percentile of |dlogp| exceeds this", 1e-2, gt=0)
    every: int = describe("also gate every N policy steps, on the engine's weights of that version (0: only at "
                          "start, before promotion and after a rollout server rejoins the fleet)", 50, ge=0)
    probe_size: int = describe("probe rollouts per check", 8, ge=1, le=MAX_BATCH)


BEST_CHECKPOINT = "best"  # TeacherConfig.checkpoint: the earlier stage that scored highest on the domain


class TeacherConfig(Strict):
    """One OPD teacher."""

    name: PathName = describe("a unique name (cache folders, its disk-tier copy and metrics use it: one folder "
                              "name, no '/')")
    checkpoint: str = describe(
        "a local HF directory, the name of an earlier stage of this run, or `best`: the completed stage whose "
        "checkpoint scored highest on the teacher's (single) domain's held-out set, chosen when the stage starts "
        "and recorded in its summary")
    domains: list[str] = describe("the domains (environments) this teacher teaches", min_length=1)
    granularity: Optional[Granularity] = describe("what the teacher stores per token (default: the stage's)", None)
    kind: str = describe("a Teacher implementation registered in teachers/ (TEACHER_KINDS): in_process (loaded in "
                         "this process), sglang (scored by the SGLang-API server at `url`), zero3 (partitioned over "
                         "the run's DeepSpeed ranks, ZeRO-3 inference)", "in_process")
    options: dict[str, Any] = describe("the teacher kind's own settings, validated by the `Options` model its class "
                                       "declares (teachers/base.py; the built-in kinds take none) before any work",
                                       {})
    device: Optional[str] = describe_device("where this teacher scores (auto | cpu | cuda | cuda:N); default: the "
                                            "run's `device`")
    url: Optional[str] = describe("kind sglang: the address of the SGLang-API server (SGLang, or `opd-sao serve`) "
                                  "that serves this teacher; `checkpoint` is then a local directory with its config "
                                  "and tokenizer (for the vocabulary checks; no weights needed)", None)
    env_options: Optional[dict[str, Any]] = describe(
        "the environment options of this teacher's domains in this stage (e.g. a `dataset:label` domain's path, "
        "prompt_key and reward), so OPD runs on your own data with no earlier stage for it; given, they win over "
        "those of the first other-kind stage whose `env` is the domain; null: that stage's (else none)", None)
    rollout: Optional[RolloutConfig] = describe(
        "episode settings of this teacher's domains (only max_new_tokens, max_turns, max_context_tokens, truncation, "
        "compaction*, prompt_format, system_prompt; sampling stays the stage's); each one given wins over the first "
        "other-kind stage's with that `env` (else the OPD stage's own); probes and evaluation use them too", None)
    eval: Optional[EvalConfig] = describe(
        "held-out evaluation of this teacher's domains (probes, the distillation summary); each setting given wins "
        "over the first other-kind stage's with that `env` (else the OPD stage's `eval`)", None)

    @model_validator(mode="after")
    def _episode_settings_only(self) -> "TeacherConfig":
        other = sorted(self.rollout.model_fields_set - set(EPISODE_FIELDS)) if self.rollout is not None else []
        if other:
            raise ValueError(f"teacher {self.name!r}: rollout.{other[0]} is the stage's (one sampling setting per "
                             f"batch); a teacher's rollout may set only {', '.join(EPISODE_FIELDS)}")
        return self


class OPDConfig(Strict):
    """On-policy distillation: teachers, granularity, divergence, cache and prefetch."""

    teachers: list[TeacherConfig] = describe("one teacher per domain", [])
    granularity: Granularity = describe("sampled, top_k, top_p or full: the teacher's distribution kept per token",
                                        "top_k")
    top_k: int = describe("top_k: tokens kept per position", 16, ge=1)
    top_p: float = describe("top_p: probability mass kept per position", 0.95, gt=0, le=1)
    max_support: int = describe("top_p: at most this many token ids per position (the nucleus cap); the rest of the "
                                "nucleus joins the tail bucket, so cache bytes and memory per token stay bounded "
                                "whatever the teacher's entropy (metric: nucleus_cap_hit_rate)", 256, ge=1)
    divergence: Divergence = describe("top_k/top_p/full: the divergence, by its name in opd_sao.algorithms."
                                      "DIVERGENCES (forward_kl, reverse_kl, jsd, or one added with "
                                      "register_divergence)", "reverse_kl")
    jsd_beta: float = describe("jsd: the mixture weight", 0.5, gt=0, lt=1)
    reward_weight: float = describe("mix the task reward (minus a running mean) into the loss", 0.0, ge=0)
    max_resident: int = describe("teachers held in memory at once (the rest on the disk tier)", 2, ge=1)
    prefetch: bool = describe("load the next teacher while the current one scores", True)
    cache_dir: Optional[str] = describe("the logit cache (default: <stage dir>/logit_cache)", None)
    local_dir: Optional[str] = describe("disk tier teachers are copied to before loading (default: <stage "
                                        "dir>/teacher_tier)", None)
    copy_bandwidth_mb_s: Optional[float] = describe("throttle the copy to the disk tier (simulates slow storage)",
                                                    None, gt=0)
    score_batch_size: int = describe("trajectories per teacher forward pass", 32, ge=1, le=MAX_BATCH)
    vocab_chunk: int = describe("vocabulary columns per lm-head chunk (teacher scoring, student support)", 8192, ge=1)
    target: float = describe("a domain is done once its held-out probe score reaches target x its teacher's score: it "
                             "stops drawing rollouts, and the stage ends when every domain is done (`steps` is the "
                             "budget)", 0.95, gt=0, le=1)
    probe_every: int = describe("policy steps between held-out probes of every domain (the student exported, its "
                                "eval split scored as the pipeline scores it, another sampling seed); each domain's "
                                "share of the rollouts follows its gap to its teacher (1 - score / teacher score); 0: "
                                "no probes, every domain drawn round robin for all `steps`", 25, ge=0)
    min_share: float = describe("with probes: every domain's floor share of the rollouts, done or not (rehearsal: "
                                "a domain that draws nothing slips while the others train); the rest follows the "
                                "gaps. At most 1 / the number of domains", 0.0, ge=0, lt=1)

    @model_validator(mode="after")
    def _one_teacher_per_domain(self) -> "OPDConfig":
        names, owner = set(), {}
        for teacher in self.teachers:
            if teacher.name in names:
                raise ValueError(f"teacher name {teacher.name!r} is used twice")
            names.add(teacher.name)
            for domain in teacher.domains:
                if domain in owner:
                    raise ValueError(f"domain {domain!r} has two teachers ({owner[domain]!r} and {teacher.name!r})")
                owner[domain] = teacher.name
        return self


# The stage fields every kind has; each of the others is read by the kinds whose `sections` name it (stages/base.py;
# docs/config.md lists the built-in kinds'), and a stage may set it only when its kind reads it.
COMMON_STAGE_FIELDS = frozenset({"name", "kind", "init_from", "trainer", "options"})

# Stage kind -> its Stage class (stages/base.py, `register_stage`). It lives here, below the stages, because the
# schema asks each stage's kind for its options, defaults and checks (`Stage.validate_in_run`) while it validates;
# the built-in kinds register themselves when opd_sao.stages is imported, which a lookup does by name.
STAGES = Registry("stage kind", home="opd_sao.stages")


def _stage_kind(value: str) -> str:
    if value not in STAGES:
        raise ValueError(STAGES.unknown(value))
    return value


class StageConfig(Strict):
    """One stage of the pipeline. A field beyond COMMON_STAGE_FIELDS that its kind does not read (the kind's
    `sections`) is refused while the config validates (`Stage.check_sections`), and left out when it is written out."""

    name: PathName = describe("a unique stage name (its folder under stages/: one folder name, no '/')")
    kind: Annotated[str, AfterValidator(_stage_kind)] = describe(
        "a stage kind registered in stages/ (sft, reasoning, agent, chat, opd, or a plugin's); it names the other "
        "fields the stage may set (the sections it reads: `opd-sao config stages`, docs/config.md)")
    env: Optional[str] = describe("an environment registered in envs/ (evaluated after every stage with this "
                                  "stage's env_options, rollout and eval)", None)
    env_options: dict[str, Any] = describe("keyword arguments of the environment", {})
    domains: list[str] = describe("the domains (environments) whose prompts the stage uses", [])
    algo: Optional[Algo] = describe("the RL algorithm preset (default: the run's `algo`); `rl.advantage` and "
                                    "`rl.policy_loss` replace its parts", None)
    steps: int = describe("policy steps (opd: the budget; sft stages count sft.steps)", 20, ge=0)
    init_from: str = describe("'base', 'previous', or an earlier stage's name", "previous")
    checkpoint_every: int = describe("policy steps (SFT: optimizer steps) between resumable state saves", 25, ge=1)
    buffer_memory: int = describe("waiting trajectories kept in host memory; the rest spill to disk", 4096, ge=1)
    trainer: StageTrainerConfig = describe("overrides of the run's trainer settings for this stage",
                                           StageTrainerConfig())
    rollout: RolloutConfig = describe("sampling and episodes (sft: the prompt format of a domain no other stage "
                                      "trains on)", RolloutConfig())
    rl: AlgoConfig = describe("the RL algorithm's parts and settings (DIS band, GAE, clip, baselines; opd: the DIS "
                              "band and baseline window); the key was `sao` before (still read, with a warning)",
                              AlgoConfig())
    sft: SFTConfig = describe("the stage's supervised warm start (sft: the stage itself)", SFTConfig())
    critic_pretrain: CriticPretrainConfig = describe(
        "with a critic (sao, ppo), value pre-training before the first step, and critic carry-over",
        CriticPretrainConfig())
    eval: EvalConfig = describe("held-out evaluation (opd: of a domain no other stage trains on)", EvalConfig())
    gate: GateConfig = describe("the consistency gate", GateConfig())
    opd: OPDConfig = describe("teachers and losses", OPDConfig())
    options: dict[str, Any] = describe("settings of the stage kind itself, validated by its `Options` model", {})

    @model_validator(mode="before")
    @classmethod
    def _renamed_sections(cls, data: Any) -> Any:
        """A stage written for an older release still loads: its `sao:` section is read as `rl:`, with a warning."""
        if isinstance(data, dict) and "sao" in data:
            log.warning("stage %r: the `sao:` section is deprecated; rename it `rl:` (the RL algorithm's settings)",
                        data.get("name"))
            data = dict(data)
            old, new = data.pop("sao"), data.get("rl", {})
            if isinstance(old, dict) and isinstance(new, dict):  # an old override beside a new section: both apply
                if set(old) & set(new):
                    raise ValueError(f"sao (the old name of rl) and rl both set {sorted(set(old) & set(new))}")
                old = {**new, **old}
            data["rl"] = old
        return data

    @model_serializer(mode="wrap")
    def _read_sections_only(self, handler) -> dict:
        """Written out (a run's config.yaml), a stage holds the fields its kind reads: it reads back through the
        same check, whatever the run filled into the sections of other kinds (the run's prompt format)."""
        reads = COMMON_STAGE_FIELDS | STAGES.get(self.kind).sections
        return {name: value for name, value in handler(self).items() if name in reads}


class CheckpointingConfig(Strict):
    """What a run keeps on disk once it no longer needs it (`--resume` never needs a finished stage's state)."""

    keep_state: Literal["last", "none", "all"] = describe(
        "resumable state of finished stages (state/: optimizer moments, weights, loop position; buffer/: the "
        "write-ahead log of waiting trajectories): last (the log deleted when the stage finishes, state/ once the "
        "next stage has started, so the last finished stage's stays), none (both deleted when the stage "
        "finishes), all (both kept)", "last")


class LoggingConfig(Strict):
    """Where metrics go."""

    wandb: bool = describe("log to wandb (offline unless WANDB_MODE says otherwise)", True)
    wandb_project: str = describe("wandb project name", "opd-sao")
    progress: bool = describe("progress lines on stdout: stage, step/steps, reward or loss, seconds per step and "
                              "ETA (docs/usage.md, \"Progress output\")", True)
    progress_every: int = describe("a progress line every this many steps (and after a task's last step)", 10, ge=1)
    progress_interval_s: float = describe("a line at least this often while a stage runs (between steps, and during "
                                          "evaluation, the gate and other work without steps)", 30.0, gt=0)


SEED_LIMIT = 2**32  # numpy, torch and random all take seeds below this (and small offsets of them)

TINY_MODEL = "tiny"  # model.path of the embedded tiny model, which every default is tuned for
# What a checkpoint as model.path gets for the trainer settings a config leaves unset, in place of the tiny model's
# (1e-4, 5e-4, which would wreck a pretrained model in a few steps): verl's PPO/GRPO defaults (ppo_trainer.yaml:
# actor optim lr 1e-6, critic optim lr 1e-5), TRL's GRPOConfig learning_rate 1e-6.
REAL_MODEL_TRAINER = {"policy_lr": 1e-6, "critic_lr": 1e-5}


def has_chat_template(path: str | Path) -> bool:
    """Whether a model directory's tokenizer has a chat template (tokenizer_config.json's `chat_template`, or the
    chat_template.jinja / .json file transformers writes; a GGUF file's `tokenizer.chat_template` key), read without
    loading the tokenizer."""
    if is_gguf_path(path):
        return gguf_has_chat_template(path)
    path = Path(path)
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((path / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def _given(section: Any) -> Optional[dict]:
    """The settings a config gives in a section (a mapping, or a model's set fields); None for anything else."""
    if section is None:
        return {}
    if isinstance(section, BaseModel):
        return section.model_dump(exclude_unset=True)
    return dict(section) if isinstance(section, dict) else None


class RunConfig(Strict):
    """A whole run: the base model, the engine, the trainer and the stages in order."""

    plugins: list[str] = describe(
        "extensions imported before the rest of the config is validated, each a Python file (path/to/my_reward.py, "
        "relative to the working directory) or an importable module name; a plugin registers stage kinds, "
        "environments, rewards, teachers, weight-sync modes or algorithms by the same decorators as the built-in "
        "ones (installed packages' entry points are loaded too: docs/extending.md)", [])
    seed: int = describe("seed of every random choice", 0, ge=0, lt=SEED_LIMIT)
    device: str = describe_device("run-wide device of every model and batch: auto (cuda when torch sees a GPU, else "
                                  "cpu), cpu, cuda or cuda:N; engine.device, trainer.device and a teacher's device "
                                  "override it", "auto")
    torch_threads: Optional[int] = describe("torch threads per process (tiny models run fastest single-threaded, and "
                                            "the rollout and trainer threads each get a core); null: torch's default",
                                            1, ge=1, le=MAX_THREADS)
    algo: Algo = describe("the RL algorithm preset of every stage (opd_sao.algorithms.PRESETS: sao, ppo, grpo, "
                          "grpo_dis, running_mean, or one added with register_preset): an advantage estimator and a "
                          "policy loss", "sao")
    prompt_format: Literal["raw", "chat"] = describe("every stage's rollout.prompt_format unless the stage sets "
                                                     "its own (raw | chat); unset with a checkpoint as model.path "
                                                     "whose tokenizer has a chat template: chat", "raw")
    run_dir: Optional[str] = describe("the run directory (default: runs/<timestamp>-<config name>)", None)
    model: ModelConfig = describe("the base model", ModelConfig())
    engine: EngineConfig = describe("the rollout engine", EngineConfig())
    trainer: TrainerConfig = describe("the trainer", TrainerConfig())
    logging: LoggingConfig = describe("metrics and progress", LoggingConfig())
    checkpointing: CheckpointingConfig = describe("what finished stages keep on disk", CheckpointingConfig())
    eval_domains: list[str] = describe("environments evaluated after every stage (default: every stage's env)", [])
    eval_scope: Literal["all", "reached"] = describe(
        "which domains a stage's evaluation scores: all (every eval domain before and after every stage, so what a "
        "stage does to domains not trained yet shows) or reached (its own domains and the earlier stages'; a domain "
        "is first scored as its own stage's `before`, on the previous checkpoint): evaluation is most of a real "
        "model's CPU run", "all")
    eval_start: bool = describe("evaluate the base model too (the report's `start` column); false skips it: a tiny "
                                "model built at random scores ~0, and its evaluation took a tenth of the quickstart",
                                True)
    stages: list[StageConfig] = describe("the stages, run in order", min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _real_model_defaults(cls, data: Any) -> Any:
        """A checkpoint as model.path (anything but `tiny`): the settings the config leaves unset get real-model
        values instead of the tiny model's (REAL_MODEL_TRAINER; prompt_format chat when the checkpoint's tokenizer
        has a chat template). They are filled into the config itself, so the run's config.yaml holds them and
        `--resume` reads the same values."""
        if not isinstance(data, dict):
            return data
        model, trainer = _given(data.get("model")), _given(data.get("trainer"))
        if model is None or trainer is None or model.get("path", TINY_MODEL) == TINY_MODEL:
            return data
        data = {**data, "trainer": {**REAL_MODEL_TRAINER, **trainer}}
        if "prompt_format" not in data and has_chat_template(model["path"]):
            data["prompt_format"] = "chat"
        return data

    @model_validator(mode="after")
    def _validate(self) -> "RunConfig":
        """The sections each stage sets, checked against its kind's first (as given: nothing filled yet); then the
        defaults that depend on other settings, filled; then each check, one concern each."""
        for stage in self.stages:
            STAGES.get(stage.kind).check_sections(stage)
        self._fill_stage_defaults()
        for check in (self._check_stage_order, self._check_devices, self._check_groups, self._check_eval_domains):
            check()
        for stage in self.stages:  # what each kind checks itself: its options, and against the rest of the run
            STAGES.get(stage.kind).validate_in_run(stage, self)
        return self

    def tiny_defaults_left(self) -> list[str]:
        """With a checkpoint as model.path, one warning line per tiny-model default still in use that is not
        replaced automatically (`_real_model_defaults`): the user should choose it for their model. A fresh run
        logs them; a resumed one has none (its config.yaml sets every field its stages read)."""
        if self.model.path == TINY_MODEL:
            return []
        tiny = [(f"rollout.{key}", RolloutConfig.model_fields[key].default,
                 [s.name for s in self.stages if STAGES.get(s.kind).generates() and key not in s.rollout.model_fields_set])
                for key in ("max_new_tokens", "max_context_tokens")]
        tiny.append(("sft.lr", SFTConfig.model_fields["lr"].default,
                     [s.name for s in self.stages if s.sft.steps and "lr" not in s.sft.model_fields_set]))
        lines = [f"model.path {self.model.path!r} is a checkpoint: {key} is the tiny model's default {default} in "
                 f"stage{'s' * (len(stages) > 1)} {', '.join(map(repr, stages))}; set it for this model"
                 for key, default, stages in tiny if stages]
        if "torch_threads" not in self.model_fields_set:
            lines.append(f"model.path {self.model.path!r} is a checkpoint: torch_threads is the tiny model's default "
                         f"{self.torch_threads}; set it for this model (null: torch's default)")
        return lines

    def _fill_stage_defaults(self) -> None:
        """A stage's prompt format is the run's, the settings its kind declares in `defaults` (the RL kinds' DIS
        band) its kind's, its group size 8 for a grouped advantage estimator and 1 otherwise, unless the stage sets
        them."""
        from opd_sao.algorithms import resolve_algorithm

        for stage in self.stages:
            if "prompt_format" not in stage.rollout.model_fields_set:
                stage.rollout.prompt_format = self.prompt_format
            STAGES.get(stage.kind).fill_defaults(stage)
            if stage.rollout.group_size is None:
                stage.rollout.group_size = 8 if resolve_algorithm(self.stage_algo(stage), stage.rl).grouped else 1

    def _check_stage_order(self) -> None:
        """Unique, unreserved names; init_from names an earlier stage."""
        for i, stage in enumerate(self.stages):
            seen = [s.name for s in self.stages[:i]]
            if stage.name in seen:
                raise ValueError(f"stage name {stage.name!r} is used twice; stage names must be unique")
            if stage.name in ("base", "previous", BEST_CHECKPOINT):
                raise ValueError(f"stage name {stage.name!r} is reserved (it names a checkpoint rule)")
            if stage.init_from not in ("base", "previous") and stage.init_from not in seen:
                raise ValueError(
                    f"stage {stage.name!r}: init_from {stage.init_from!r} is not an earlier stage "
                    f"(use 'base', 'previous' or one of {seen})"
                )

    def _check_devices(self) -> None:
        """Every device named (run, engine, each stage's trainer) exists on this machine (a kind checks its own, such
        as OPD teachers', in `validate_in_run`); each stage's trainer with its overrides is a valid trainer."""
        require_device("device" if self.engine.device is None else "engine.device", self.engine_device)
        for stage in self.stages:
            try:
                trainer = self.stage_trainer(stage)
            except ValidationError as err:
                raise ValueError(f"stage {stage.name!r}: trainer.{format_error(err)}") from None
            require_device(f"stage {stage.name!r}: trainer.device", trainer.device)

    def _check_groups(self) -> None:
        """Grouped estimators get groups; compaction none; a batch is whole groups."""
        from opd_sao.algorithms import resolve_algorithm

        for stage in self.stages:
            advantage, size = resolve_algorithm(self.stage_algo(stage), stage.rl).advantage, stage.rollout.group_size
            if advantage.grouped and size < 2:
                raise ValueError(f"stage {stage.name!r}: {self.stage_algo(stage)} (advantage {advantage.name}) "
                                 f"needs rollout.group_size >= 2")
            if stage.rollout.compaction and size > 1:
                raise ValueError(f"stage {stage.name!r}: rollout.compaction needs group_size 1 (a compacted episode "
                                 f"is several trajectories, which a group cannot compare)")
            batch = self.stage_trainer(stage).train_batch_size
            if batch % size:
                raise ValueError(f"stage {stage.name!r}: trainer.train_batch_size {batch} must be a multiple of "
                                 f"rollout.group_size {size}")

    def _check_eval_domains(self) -> None:
        envs = {stage.env for stage in self.stages if stage.env}
        if set(self.eval_domains) - envs:
            raise ValueError(f"eval_domains {sorted(set(self.eval_domains) - envs)} are not the env of any stage "
                             f"({sorted(envs)})")

    def stage_algo(self, stage: StageConfig) -> str:
        return stage.algo or self.algo

    def stage_trainer(self, stage: StageConfig) -> TrainerConfig:
        """The run's trainer settings with the stage's overrides; `device` filled in from the run's."""
        trainer = TrainerConfig(**{**self.trainer.model_dump(), **stage.trainer.model_dump()})
        if trainer.device is None:
            trainer.device = self.device
        return trainer

    @property
    def engine_device(self) -> str:
        return self.engine.device or self.device


def type_name(annotation) -> str:
    """A readable type: `int`, `float | null`, `'torch' | 'deepspeed'`, `list[TeacherConfig]`."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin is Annotated:
        return type_name(args[0])
    if origin in (Union, UnionType):
        return " | ".join("null" if a is type(None) else type_name(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(type_name(a) for a in args)}]"
    return getattr(annotation, "__name__", str(annotation))


def field_docs(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted path, type, default, description) of every setting, nested sections expanded."""
    rows = []
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        kind = info.annotation
        nested = kind if isinstance(kind, type) and issubclass(kind, BaseModel) else None
        if nested is None and getattr(kind, "__origin__", None) is list:
            inner = kind.__args__[0]
            nested = inner if isinstance(inner, type) and issubclass(inner, BaseModel) else None
            path_inner = f"{path}[]."
        else:
            path_inner = f"{path}."
        default = "required" if info.is_required() else ("..." if nested and not isinstance(info.default, list)
                                                          else repr(info.default))
        rows.append((path, type_name(kind), default, info.description or ""))
        if nested is not None:
            rows.extend(field_docs(nested, path_inner))
    return rows


def config_reference(prefix: str = "", *, markdown: bool = False) -> str:
    """Every setting under `prefix` as aligned text, or as the markdown table of docs/config.md."""
    rows = [r for r in field_docs() if r[0].startswith(prefix)]
    if not rows:
        raise ConfigError(f"no config setting starts with {prefix!r} (try `opd-sao config` for all of them)")
    # with the stage kinds' own row, which sections each built-in kind reads (a stage may set no other)
    kinds = [(kind, ", ".join(sorted(STAGES.get(kind).sections))) for kind in STAGES.built_ins()] \
        if "stages[].kind".startswith(prefix) else []
    common = ", ".join(sorted(COMMON_STAGE_FIELDS))
    if markdown:
        lines = ["| setting | type | default | what it does |", "| --- | --- | --- | --- |"]
        lines += ["| `{}` | {} | {} | {} |".format(*(c.replace("|", "\\|") for c in row)) for row in rows]
        if kinds:
            lines += ["", f"| stage kind | the sections it reads, beyond every kind's {common} |", "| --- | --- |"]
            lines += [f"| `{kind}` | {sections} |" for kind, sections in kinds]
        return "\n".join(lines)
    width = max(len(r[0]) for r in rows)
    lines = [f"{path:<{width}}  {kind} = {default}\n{'':<{width}}  {text}" for path, kind, default, text in rows]
    if kinds:
        lines.append(f"\nthe sections each stage kind reads, beyond every kind's {common}:")
        lines += [f"  {kind}: {sections}" for kind, sections in kinds]
    return "\n".join(lines)


def format_error(err: ValidationError) -> str:
    """The first validation error as one line: where, what, and the value given."""
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    message = first["msg"].removeprefix("Value error, ")  # a validator's own message already names the field
    got = first.get("input")
    shown = f" (got {got!r})" if got is not None and not isinstance(got, dict) else ""
    more = f"; and {err.error_count() - 1} more" if err.error_count() > 1 else ""
    return f"{where + ': ' if where else ''}{message}{shown}{more}"


MAX_CONFIG_BYTES = 4 << 20  # a config is settings, not data
MAX_YAML_NODES = 100_000  # nodes of a document with every alias expanded (a "billion laughs" is 10**9)
MAX_YAML_DEPTH = 64


class _ConfigLoader(yaml.SafeLoader):
    """Safe YAML with limits: a document is refused before it is built when its aliases would expand it past
    MAX_YAML_NODES nodes or MAX_YAML_DEPTH levels, and a mapping that sets a key twice is refused (plain YAML keeps
    the last silently: a second `stages:` replaced the first list)."""

    def compose_document(self):
        node = super().compose_document()
        _expanded_size(node, 0, {})
        return node

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                continue
            key = self.construct_object(key_node)
            if key in seen:
                raise ConfigError(f"line {key_node.start_mark.line + 1}: key {key!r} is set twice (first on line "
                                  f"{seen[key]}); YAML would keep only the last")
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _expanded_size(node: yaml.Node, depth: int, memo: dict) -> tuple[int, int]:
    """(nodes, height) of `node` with every alias expanded; an alias is a shared node, so each is counted once."""
    if depth > MAX_YAML_DEPTH:
        raise ConfigError(f"line {node.start_mark.line + 1}: nested more than {MAX_YAML_DEPTH} levels deep")
    if id(node) not in memo:
        children = (node.value if isinstance(node, yaml.SequenceNode) else
                    [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else [])
        sizes = [_expanded_size(child, depth + 1, memo) for child in children]
        memo[id(node)] = (1 + sum(n for n, _ in sizes), 1 + max((h for _, h in sizes), default=0))
    nodes, height = memo[id(node)]
    if depth + height > MAX_YAML_DEPTH:
        raise ConfigError(f"line {node.start_mark.line + 1}: nested more than {MAX_YAML_DEPTH} levels deep")
    if nodes > MAX_YAML_NODES:
        raise ConfigError(f"line {node.start_mark.line + 1}: expands to more than {MAX_YAML_NODES:,} values with its "
                          f"aliases (an alias bomb?)")
    return nodes, height


def load_yaml(text: str, where: str) -> Any:
    """`text` as YAML under the limits of `_ConfigLoader`; any problem is a ConfigError starting with `where`."""
    try:
        return yaml.load(text, Loader=_ConfigLoader)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{where}: not valid YAML: {str(err).splitlines()[0]}") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested more than {MAX_YAML_DEPTH} levels deep") from None


def _apply_override(data: dict, dotted: str) -> None:
    """`a.b.c=value`; list items by index or, for stages, by stage name."""
    if "=" not in dotted:
        raise ConfigError(f"override {dotted!r} must look like key.path=value")
    key, raw = dotted.split("=", 1)
    value = load_yaml(raw, f"override {dotted!r}: the value") if raw else ""
    node: Any = data
    parts = key.split(".")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            index = next((j for j, item in enumerate(node) if isinstance(item, dict) and item.get("name") == part), None)
            if index is None and part.lstrip("-").isdigit():
                index = int(part)
            if index is None or not -len(node) <= index < len(node):
                raise ConfigError(f"override {key!r}: no list item {part!r}")
            if last:
                node[index] = value
            else:
                node = node[index]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                node = node.setdefault(part, {})
        else:
            raise ConfigError(f"override {key!r}: {'.'.join(parts[:i])} is not a mapping")


def parse_config(data: dict, overrides: list[str] = ()) -> RunConfig:
    if not isinstance(data, dict):
        raise ConfigError("config must be a YAML mapping at the top level")
    for item in overrides:
        _apply_override(data, item)
    plugins = data.get("plugins", [])
    if not isinstance(plugins, list) or not all(isinstance(p, str) for p in plugins):
        raise ConfigError(f"plugins: a list of .py files or module names (got {plugins!r})")
    try:
        load_plugins(plugins)  # what they register (an algo, a stage kind) is then known to validation
    except ValueError as err:
        raise ConfigError(str(err)) from None
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_error(err)) from None


def load_config(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} is not a file")
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"config file {str(path)!r} is {path.stat().st_size:,} bytes; a config is at most "
                              f"{MAX_CONFIG_BYTES:,}")
        text = path.read_bytes().decode("utf-8")
    except OSError as err:
        raise ConfigError(f"cannot read config file {str(path)!r}: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte {err.object[err.start]:#04x} at "
                          f"offset {err.start})") from None
    return parse_config(load_yaml(text, str(path)) or {}, overrides)
