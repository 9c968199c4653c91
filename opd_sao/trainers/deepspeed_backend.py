"""DeepSpeed ZeRO trainer backend: policy and critic as DeepSpeed engines, data parallel over ranks.

Rank 0 drives: it runs the pipeline, the rollouts and the `Learner`, exactly as with the torch backend.
Every other rank runs `follow()`: it receives each of rank 0's backend calls (announced over
torch.distributed), computes the forward and backward passes of its share of the batch rows, and takes
part in ZeRO's collectives. The loss is computed once, on rank 0, over the whole batch; its gradient
with respect to the per-token outputs is broadcast and every rank back-propagates its own rows. The
update is therefore the single-process update (token mean over the whole batch, clipping on the global
gradient norm) whatever the world size, and the Learner stays backend-agnostic.

Launch (see docs/scale_out.md): `deepspeed --num_gpus N $(which opd-sao) run CONFIG trainer.backend=deepspeed`
or `torchrun --nproc_per_node N -m opd_sao.cli run ...`; in a plain single process the backend starts a
world of one itself.
"""
from __future__ import annotations

import atexit
import copy
import gc
import importlib
import json
import logging
import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from opd_sao.checkpoints import load_causal_lm, save_checkpoint

from ..config import TrainerConfig
from ..devices import resolve_device
from ..modeling import sequence_logprobs
from .base import SupportLogprobs, TrainerBackend, action_support_logprobs, adamw
from .critic import ValueModel

# Followers block in a broadcast while rank 0 runs SFT, evaluations or rollouts; those can take hours.
COLLECTIVE_TIMEOUT = timedelta(hours=6)


@dataclass
class Rows:
    """The part of a batch the trainer's forward passes need; what rank 0 sends to the other ranks."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    top_p: Optional[torch.Tensor] = None  # [B] each row's sampling nucleus (policy forwards)
    action_mask: Optional[torch.Tensor] = None  # [B, T] policy forwards score these tokens only; support forwards
    # give one output row per action token


@dataclass
class _Pending:
    """A grad=True output waiting for its loss: this rank's rows lo:hi of it (with graph) and rank 0's leaf (the
    whole output, `shape`)."""

    local: torch.Tensor
    lo: int
    hi: int
    shape: tuple
    leaf: Optional[torch.Tensor]

    def grad_share(self, grad: torch.Tensor) -> torch.Tensor:
        """This rank's part of the leaf's gradient, cut to `local`'s shape (a share may be narrower)."""
        return grad[self.lo:self.hi][(slice(None),) + tuple(slice(0, n) for n in self.local.shape[1:])]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device: Optional[torch.device] = None) -> None:
    """Join the launcher's process group, or start a world of one when run as a plain process.

    A launched rank uses its launcher's GPU (LOCAL_RANK); a world of one uses `device`'s index if it names one.
    """
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    if dist.is_initialized():
        return
    index = int(os.environ.get("LOCAL_RANK", "0"))
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
        index = device.index if device is not None and device.index is not None else 0
    get_accelerator().set_device(index)
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                               timeout=COLLECTIVE_TIMEOUT, verbose=False)


def deepspeed_config(cfg: TrainerConfig, lr: float) -> dict:
    """The user's `trainer.deepspeed_config` with the defaults this backend relies on filled in."""
    ds = copy.deepcopy(cfg.deepspeed_config or {})
    ds.setdefault("train_micro_batch_size_per_gpu", 1)  # nominal: a forward takes a whole batch share
    ds.setdefault("gradient_accumulation_steps", 1)
    ds.setdefault("gradient_clipping", cfg.grad_clip)
    ds.setdefault("steps_per_print", 10**9)
    ds.setdefault("zero_optimization", {"stage": 2})
    if ds["zero_optimization"].get("stage", 0) not in (1, 2, 3):
        raise ValueError("trainer.deepspeed_config.zero_optimization.stage must be 1, 2 or 3 "
                         "(for unsharded single-process training use trainer.backend: torch)")
    if ds["gradient_accumulation_steps"] != 1:
        raise ValueError("trainer.deepspeed_config.gradient_accumulation_steps must be 1: "
                         "one Learner step is one optimizer step")
    if ds.get("fp16", {}).get("enabled"):
        raise ValueError("trainer.deepspeed_config.fp16 is not supported; use trainer.dtype: bfloat16")
    bf16 = bool(ds.get("bf16", {}).get("enabled", cfg.dtype == "bfloat16"))
    if bf16 != (cfg.dtype == "bfloat16"):
        raise ValueError(f"trainer.deepspeed_config.bf16.enabled={bf16} contradicts trainer.dtype={cfg.dtype}")
    ds["bf16"] = {**ds.get("bf16", {}), "enabled": bf16}
    if "optimizer" in ds:  # DeepSpeed builds it (e.g. DeepSpeedCPUAdam for offload); the lr is ours
        ds["optimizer"].setdefault("params", {})["lr"] = lr
    else:  # torch AdamW, as the torch backend: no optimizer op to compile
        ds.setdefault("zero_allow_untested_optimizer", True)
        if ds["zero_optimization"].get("offload_optimizer", {}).get("device", "none") != "none":
            ds.setdefault("zero_force_ds_cpu_optimizer", False)
    return ds


class DeepSpeedTrainer(TrainerBackend):
    def __init__(self, checkpoint: str | Path, cfg: TrainerConfig, *, with_critic: bool = True,
                 critic_from: str | Path | None = None):
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        wanted = resolve_device(cfg.device)
        init_distributed(wanted)
        self.cfg, self.checkpoint = cfg, str(checkpoint)
        critic_from = str(critic_from) if critic_from else None
        self.critic_source = critic_from or self.checkpoint  # where the critic loads from
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device(get_accelerator().current_device_name())
        if self.device.type != wanted.type:
            raise ValueError(f"trainer.device {cfg.device!r} is {wanted}, but DeepSpeed's accelerator runs on "
                             f"{self.device} (DS_ACCELERATOR={wanted.type} chooses it)")
        self._announce("init", checkpoint=self.checkpoint, cfg=cfg.model_dump(), with_critic=with_critic,
                       critic_from=critic_from)
        policy_ds = deepspeed_config(cfg, cfg.policy_lr)
        # Under ZeRO-3 every rank loads the full model, then DeepSpeed partitions it (partitioning while
        # loading needs transformers' DeepSpeed integration, hence `accelerate`, which is no dependency).
        self.zero3 = policy_ds["zero_optimization"]["stage"] == 3
        policy = load_causal_lm(checkpoint, "float32")
        self.policy, _ = self._engine(deepspeed, policy, policy_ds, cfg.policy_lr, cfg)
        self.critic = None
        if with_critic:
            critic = ValueModel.from_pretrained(self.critic_source, "float32")
            if cfg.freeze_critic_attention:
                critic.freeze_attention()
            # The head reads fp32 hidden states; under bf16 DeepSpeed casts the head too.
            critic.value_head.register_forward_pre_hook(lambda mod, args: (args[0].to(mod.weight.dtype),))
            self.critic, _ = self._engine(deepspeed, critic, deepspeed_config(cfg, cfg.critic_lr), cfg.critic_lr, cfg)
        self._pending: dict[str, list[_Pending]] = {"policy": [], "critic": []}
        self.policy_version = 0
        if self.rank == 0 and self.world > 1 and not _followers_waiting:
            _followers_waiting.append(True)
            atexit.register(_release_followers)

    @staticmethod
    def _engine(deepspeed, model: torch.nn.Module, ds: dict, lr: float, cfg: TrainerConfig):
        trainable = [p for p in model.parameters() if p.requires_grad]
        if "optimizer" in ds:
            return deepspeed.initialize(model=model, model_parameters=trainable, config=ds)[:2]
        opt = adamw(trainable, lr, cfg)
        return deepspeed.initialize(model=model, optimizer=opt, config=ds)[:2]

    # --- the rank-0-drives protocol -------------------------------------------------------------------

    def _announce(self, op: str, **kwargs) -> None:
        """Rank 0 tells the followers which call comes next, with its arguments."""
        if self.rank == 0 and self.world > 1:
            dist.broadcast_object_list([(op, kwargs)], src=0)

    # --- forward passes --------------------------------------------------------------------------------

    def policy_logprobs(self, batch, temperature: float, grad: bool) -> torch.Tensor:
        rows = Rows(batch.input_ids.cpu(), batch.attention_mask.cpu(), batch.top_p, batch.action_mask.cpu())
        self._announce("_forward", kind="policy", rows=rows, temperature=temperature, grad=grad)
        return self._forward("policy", rows, temperature, grad)

    def critic_values(self, batch, grad: bool) -> torch.Tensor:
        if self.critic is None:
            raise RuntimeError("this trainer was built without a critic (the algorithm needs none)")
        rows = Rows(batch.input_ids.cpu(), batch.attention_mask.cpu())
        self._announce("_forward", kind="critic", rows=rows, temperature=1.0, grad=grad)
        return self._forward("critic", rows, 1.0, grad)

    def _shares(self, B: int) -> list[tuple[int, int]]:
        """Each rank's contiguous share lo:hi of B batch rows (empty at the end when B < world)."""
        chunk = -(-B // self.world)
        return [(min(B, r * chunk), min(B, (r + 1) * chunk)) for r in range(self.world)]

    def _local_rows(self, rows: Rows, lo: int, hi: int) -> tuple[torch.Tensor, ...]:
        """Rows lo:hi (input ids, attention mask, action mask if any) on this rank's device, cut at their longest
        sequence (right padding: the columns past it are padding)."""
        mask = rows.attention_mask[lo:hi]
        width = max(1, int(mask.sum(-1).max()))
        out = [rows.input_ids[lo:hi, :width], mask[:, :width]]
        if rows.action_mask is not None:
            out.append(rows.action_mask[lo:hi, :width])
        return tuple(x.to(self.device) for x in out)

    def _forward(self, kind: str, rows: Rows, temperature: float, grad: bool) -> Optional[torch.Tensor]:
        """This rank's contiguous share of the rows, gathered into the full [B, T] tensor on rank 0."""
        B, T = rows.input_ids.shape
        shares = self._shares(B)
        lo, hi = shares[self.rank]
        active = hi > lo
        if not active:  # ZeRO-3 forwards are collective: every rank runs one, an empty share on a real row
            lo, hi = 0, 1
        ids, mask, *acted = self._local_rows(rows, lo, hi)
        engine = self.policy if kind == "policy" else self.critic
        with torch.set_grad_enabled(grad):
            if kind == "policy":  # scored at the action tokens only, the ones every caller reads
                top_p = rows.top_p[lo:hi] if rows.top_p is not None else None
                local = sequence_logprobs(engine, ids, mask, temperature, top_p=top_p, full_logits=self.zero3,
                                          only=acted[0] if acted else None)
            else:
                local = engine(ids, mask).float()
            if not active:
                local = local * 0
        return self._output(kind, local, lo, [h - l for l, h in shares], (T,), grad)

    def _output(self, kind: str, local: torch.Tensor, lo: int, counts: list[int], trailing: tuple,
                grad: bool) -> Optional[torch.Tensor]:
        """Every rank's `local` rows (rank r's: counts[r] rows, starting at row `lo` of the whole) gathered on rank
        0 as a leaf; with grad, `local` waits for the next step of `kind`."""
        whole = self._gather(local.detach(), counts, trailing)
        leaf = whole.clone().requires_grad_(grad) if self.rank == 0 else None  # rank 0's loss is computed here
        if grad:
            self._pending[kind].append(_Pending(local, lo, lo + local.shape[0], tuple(whole.shape), leaf))
        return leaf

    def _gather(self, local: torch.Tensor, counts: list[int], trailing: tuple) -> torch.Tensor:
        """[sum(counts), *trailing]: rank r's first counts[r] rows, in rank order (each share zero-padded to the
        largest, and to `trailing` where it is narrower)."""
        padded = torch.zeros((max(1, max(counts)), *trailing), dtype=local.dtype, device=self.device)
        rows = min(counts[self.rank], local.shape[0])
        padded[(slice(0, rows),) + tuple(slice(0, n) for n in local.shape[1:])] = local[:rows]
        parts = [padded]
        if self.world > 1:
            parts = [torch.empty_like(padded) for _ in range(self.world)]
            dist.all_gather(parts, padded)
        return torch.cat([part[:n] for part, n in zip(parts, counts)])

    def policy_support_logprobs(self, batch, support_ids, support_mask, *, vocab_chunk: int,
                                top_k: int) -> SupportLogprobs:
        """Each rank computes the action rows of its share of the trajectories (it receives only those rows of the
        support); rank 0 gets the whole outputs, the log-probs and the tail as leaves for `step_policy`."""
        if self.zero3:  # config refuses this: the chunked lm head reads a weight ZeRO-3 holds only inside forward
            raise RuntimeError("under ZeRO-3 the policy's lm head weight is partitioned: support log-probs need "
                               "ZeRO stage 1 or 2")
        rows = Rows(batch.input_ids.cpu(), batch.attention_mask.cpu(), action_mask=batch.action_mask.cpu())
        self._announce("_support_forward", rows=rows, whole_vocab=support_ids is None, vocab_chunk=vocab_chunk,
                       top_k=top_k)
        return self._support_forward(rows, support_ids is None, vocab_chunk, top_k, (support_ids, support_mask))

    def _support_forward(self, rows: Rows, whole_vocab: bool, vocab_chunk: int, top_k: int,
                         support: tuple = (None, None)) -> SupportLogprobs:
        starts = torch.cat([torch.zeros(1, dtype=torch.long), rows.action_mask.bool().sum(1).cumsum(0)])
        shares = self._shares(rows.input_ids.shape[0])
        row_shares = [(int(starts[lo]), int(starts[hi])) for lo, hi in shares]  # each share's action rows
        ids, mask = support
        if not whole_vocab and self.world > 1:  # each rank receives its rows of the support only
            parts = [(ids[a:b].cpu(), mask[a:b].cpu()) for a, b in row_shares] if self.rank == 0 else None
            box = [None]
            dist.scatter_object_list(box, parts, src=0)
            ids, mask = box[0]
        if not whole_vocab:
            ids, mask = ids.to(self.device), mask.to(self.device)
        lo, hi = shares[self.rank]
        active = hi > lo
        input_ids, attention, action = self._local_rows(rows, *((lo, hi) if active else (0, 1)))
        if not active:  # no rows, but a backward (of zeros) through every weight all the same, as ZeRO expects
            action = torch.zeros_like(action)
        with torch.enable_grad():
            logp, tail, top = action_support_logprobs(self.policy.module, input_ids, attention, action, ids, mask,
                                                      vocab_chunk=vocab_chunk, top_k=top_k)
        r_lo, counts = row_shares[self.rank][0], [b - a for a, b in row_shares]
        outputs = [self._output("policy", x, r_lo, counts, tuple(x.shape[1:]), grad=True) for x in (logp, tail)]
        if top is not None:
            top = self._gather(top, counts, tuple(top.shape[1:]))
        return outputs[0], outputs[1], top

    # --- updates ---------------------------------------------------------------------------------------

    def step_policy(self, loss: Optional[torch.Tensor]) -> float:
        norm = self._step("policy", loss)
        self.policy_version += 1
        return norm

    def step_critic(self, loss: Optional[torch.Tensor]) -> float:
        return self._step("critic", loss)

    def _step(self, kind: str, loss: Optional[torch.Tensor]) -> float:
        """Back-propagate the loss through every grad=True forward of `kind` since the last step; one optimizer
        step."""
        self._announce(f"step_{kind}", loss=None)
        pending, self._pending[kind] = self._pending[kind], []
        if not pending:
            raise RuntimeError(f"step_{kind} needs a {kind} forward with grad=True first")
        if self.rank == 0:
            grads = torch.autograd.grad(loss, [p.leaf for p in pending], allow_unused=True)
            grads = [torch.zeros(p.shape, device=self.device) if g is None
                     else g.to(self.device, torch.float32).contiguous() for p, g in zip(pending, grads)]
        else:
            grads = [torch.empty(p.shape, dtype=torch.float32, device=self.device) for p in pending]
        if self.world > 1:
            for grad in grads:
                dist.broadcast(grad, src=0)
        # DeepSpeed averages gradients over ranks; the sum over ranks is the loss's gradient.
        surrogate = sum((p.local * p.grad_share(g)).sum() for p, g in zip(pending, grads)) * self.world
        engine = self.policy if kind == "policy" else self.critic
        engine.backward(surrogate)
        engine.step()
        norm = engine.get_global_grad_norm()
        return float("nan") if norm is None else float(norm)

    # --- weights out -----------------------------------------------------------------------------------

    @property
    def policy_model(self) -> torch.nn.Module:
        """The policy module, on the accelerator, for ZeRO stages 0-2 (full weights on every rank)."""
        if self.zero3:  # a direct forward would gather partitions alone and hang the other ranks
            raise RuntimeError("under ZeRO-3 the policy is partitioned across ranks: use policy_logprobs() "
                               "or policy_state_dict(), not policy_model")
        return self.policy.module

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights on CPU on rank 0 (ZeRO-3: gathered one tensor at a time); {} on the other ranks."""
        self._announce("policy_state_dict")
        return self._full_state_dict(self.policy)

    def _full_state_dict(self, engine) -> dict[str, torch.Tensor]:
        import deepspeed

        out: dict[str, torch.Tensor] = {}
        first_name: dict[int, str] = {}
        for name, tensor in engine.module.state_dict(keep_vars=True).items():
            if id(tensor) in first_name:  # tied weights: one copy, under both names
                if self.rank == 0:
                    out[name] = out[first_name[id(tensor)]]
                continue
            first_name[id(tensor)] = name
            partitioned = self.zero3 and hasattr(tensor, "ds_id")
            with deepspeed.zero.GatheredParameters([tensor], enabled=partitioned):
                if self.rank == 0:
                    out[name] = tensor.detach().to("cpu", copy=True)
        return out

    def export_policy(self, out_dir: Path, tokenizer=None) -> Path:
        """Rank 0 writes an HF checkpoint in trainer.dtype; the other ranks only help gather."""
        self._announce("export_policy", out_dir=str(out_dir))
        state = self._full_state_dict(self.policy)
        if self.rank == 0:
            model = load_causal_lm(self.checkpoint, self.cfg.dtype)
            model.load_state_dict(state)
            save_checkpoint(model, tokenizer, Path(out_dir))
        if self.world > 1:
            dist.barrier()
        return Path(out_dir)

    def export_critic(self, out_dir: Path) -> Path:
        """Rank 0 writes the critic (fp32, as it trains); the other ranks only help gather."""
        if self.critic is None:
            raise RuntimeError("this trainer was built without a critic (the algorithm needs none)")
        self._announce("export_critic", out_dir=str(out_dir))
        state = self._full_state_dict(self.critic)
        if self.rank == 0:
            critic = ValueModel.from_pretrained(self.critic_source, "float32")
            critic.load_state_dict(state)
            critic.save_pretrained(Path(out_dir))
        if self.world > 1:
            dist.barrier()
        return Path(out_dir)

    # --- resumable state -------------------------------------------------------------------------------

    def save_state(self, out_dir: Path) -> None:
        """DeepSpeed checkpoints of both engines (every rank writes its shards: a shared filesystem)."""
        self._announce("save_state", out_dir=str(out_dir))
        out_dir = Path(out_dir)
        self.policy.save_checkpoint(str(out_dir / "policy"), tag="state")
        if self.critic is not None:
            self.critic.save_checkpoint(str(out_dir / "critic"), tag="state")
        if self.rank == 0:
            (out_dir / "trainer_meta.json").write_text(json.dumps({"policy_version": self.policy_version}))
        if self.world > 1:
            dist.barrier()

    def load_state(self, in_dir: Path) -> None:
        self._announce("load_state", in_dir=str(in_dir))
        in_dir = Path(in_dir)
        for engine, sub in ((self.policy, "policy"), (self.critic, "critic")):
            if engine is None:
                continue
            path, _ = engine.load_checkpoint(str(in_dir / sub), tag="state")
            if path is None:
                raise FileNotFoundError(f"no DeepSpeed {sub} checkpoint under {in_dir / sub}")
        self.policy_version = json.loads((in_dir / "trainer_meta.json").read_text())["policy_version"]


_followers_waiting: list[bool] = []  # rank 0: set once followers wait for calls; released at exit


def _release_followers() -> None:
    """Rank 0 at exit: tell the followers to stop, then tear the process group down. A gloo group left alive
    until interpreter teardown can abort the process ("terminate called without an active exception")."""
    if dist.is_initialized():
        dist.broadcast_object_list([("exit", {})], src=0)
        dist.destroy_process_group()


def shut_down(code: int) -> None:
    """End a rank's process now: release the followers (rank 0), destroy the process group, flush, and exit
    without interpreter teardown, where torch's and DeepSpeed's C++ threads can abort a finished process."""
    if dist.is_initialized():
        if dist.get_rank() == 0:
            _release_followers()
        else:
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def on_every_rank(target: str, **kwargs):
    """Rank 0: run the function `module:name`(**kwargs) on every rank of the launch, the followers too, and return
    rank 0's result. For work outside the trainer that every rank must join (a ZeRO-3 sharded teacher's load
    and forward: `teachers/sharded.py`); call it from the thread that drives the trainer, as every announced
    call, so the ranks see the same order of collectives. Without followers (one process) it is a plain call."""
    if dist.is_initialized() and dist.get_rank() == 0 and dist.get_world_size() > 1:
        dist.broadcast_object_list([("call", {"target": target, "kwargs": kwargs})], src=0)
    return _resolve(target)(**kwargs)


def _resolve(target: str):
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def follow(run_cfg=None) -> int:
    """A non-zero rank: mirror rank 0's backend calls until rank 0 exits.

    `run_cfg` (the pipeline's RunConfig) lets a rank that would wait for nothing fail at once.
    """
    if run_cfg is not None and not any(run_cfg.stage_trainer(s).backend == "deepspeed" for s in run_cfg.stages):
        raise ValueError(f"launched as rank {os.environ.get('RANK')} of a multi-process run, but no stage uses "
                         "trainer.backend: deepspeed (only DeepSpeed training uses the other ranks)")
    init_distributed()
    if dist.get_rank() == 0:
        raise RuntimeError("follow() is for ranks other than 0; rank 0 runs the pipeline")
    trainer: Optional[DeepSpeedTrainer] = None
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        op, kwargs = box[0]
        if op == "exit":
            dist.destroy_process_group()
            return 0
        if op == "call":
            _resolve(kwargs["target"])(**kwargs["kwargs"])
        elif op == "init":
            trainer = None  # a new stage: free the previous engines first
            gc.collect()
            trainer = DeepSpeedTrainer(kwargs["checkpoint"], TrainerConfig(**kwargs["cfg"]),
                                       with_critic=kwargs["with_critic"], critic_from=kwargs["critic_from"])
        else:
            getattr(trainer, op)(**kwargs)
