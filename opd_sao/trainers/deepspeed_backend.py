"""DeepSpeed ZeRO trainer backend: policy and critic as DeepSpeed engines, data parallel over ranks.

Rank 0 drives: it runs the pipeline, the rollouts and the `Learner`, exactly as with the torch backend.
Every other rank runs `follow()`: it receives each of rank 0's backend calls (announced over
torch.distributed), computes the forward and backward passes of its share of the batch rows, and takes
part in ZeRO's collectives. The loss is computed once, on rank 0, over the whole batch; its gradient
with respect to the per-token outputs is broadcast and every rank back-propagates its own rows. The
update is therefore the single-process update (token mean over the whole batch, clipping on the global
gradient norm) whatever the world size, and the Learner stays backend-agnostic.

Launch (see docs/scale_out.md): `deepspeed --num_gpus N $(which opd-sao) run CONFIG trainer.backend=deepspeed`
or `torchrun --nproc_per_node N -m opd_sao.app.cli run ...`; in a plain single process the backend starts a
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
from functools import partial
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from opd_sao.checkpoints import load_causal_lm, save_checkpoint
from opd_sao.errors import UsageError

from ..config import TrainerConfig
from ..devices import resolve_device
from ..model import action_support_logprobs, moe_blocks, sequence_logprobs
from .base import (
    SupportLogprobs,
    TrainerBackend,
    action_rows_of,
    adamw,
    lr_scheduler,
    prepare,
    require_finite,
    split,
    weights_dtype,
)
from .critic import ValueModel
from .micro_batches import Deferred, Outputs, Rows, micro_forward, widen

# Followers block in a broadcast while rank 0 runs SFT, evaluations or rollouts; those can take hours.
COLLECTIVE_TIMEOUT = timedelta(hours=6)


@dataclass
class _Pending:
    """A grad=True forward waiting for its loss: this rank's rows lo:lo + n of its outputs (with their graph, or
    no-graph leaves that `deferred` re-runs in micro-batches) and rank 0's leaves (the whole outputs, `shapes`)."""

    local: tuple[torch.Tensor, ...]
    lo: int
    shapes: list[tuple]
    leaves: list[Optional[torch.Tensor]]
    deferred: Optional[Deferred]

    def grad_shares(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's part of each leaf's gradient, cut to its local output's shape (a share may be narrower)."""
        return [grad[self.lo:self.lo + x.shape[0]][(slice(None),) + tuple(slice(0, n) for n in x.shape[1:])]
                for x, grad in zip(self.local, grads)]


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
        raise UsageError("trainer.deepspeed_config.zero_optimization.stage must be 1, 2 or 3 "
                         "(for unsharded single-process training use trainer.backend: torch)")
    if ds["gradient_accumulation_steps"] != 1:
        raise UsageError("trainer.deepspeed_config.gradient_accumulation_steps must be 1: "
                         "one Learner step is one optimizer step")
    if ds.get("fp16", {}).get("enabled"):
        raise UsageError("trainer.deepspeed_config.fp16 is not supported; use trainer.dtype: bfloat16")
    bf16 = bool(ds.get("bf16", {}).get("enabled", cfg.dtype == "bfloat16"))
    if bf16 != (cfg.dtype == "bfloat16"):
        raise UsageError(f"trainer.deepspeed_config.bf16.enabled={bf16} contradicts trainer.dtype={cfg.dtype}")
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
                 critic_from: str | Path | None = None, attn_implementation: str = "eager",
                 total_steps: Optional[int] = None):
        """`total_steps`: the stage's policy steps, where a cosine lr schedule ends (the critic's: x critic_steps)."""
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
            raise UsageError(f"trainer.device {cfg.device!r} is {wanted}, but DeepSpeed's accelerator runs on "
                             f"{self.device} (DS_ACCELERATOR={wanted.type} chooses it)")
        self._announce("init", checkpoint=self.checkpoint, cfg=cfg.model_dump(), with_critic=with_critic,
                       critic_from=critic_from, attn_implementation=attn_implementation, total_steps=total_steps)
        self.attn_implementation = attn_implementation
        policy_ds = deepspeed_config(cfg, cfg.policy_lr)
        # Under ZeRO-3 every rank loads the full model, then DeepSpeed partitions it (partitioning while
        # loading needs transformers' DeepSpeed integration, hence `accelerate`, which is no dependency).
        self.zero3 = policy_ds["zero_optimization"]["stage"] == 3
        policy = prepare(load_causal_lm(checkpoint, weights_dtype(cfg), attn_implementation=attn_implementation), cfg)
        self.policy, _ = self._engine(deepspeed, policy, policy_ds, cfg.policy_lr, cfg, total_steps)
        self.critic = None
        if with_critic:
            critic = prepare(ValueModel.from_pretrained(self.critic_source, weights_dtype(cfg), attn_implementation),
                             cfg)
            if cfg.freeze_critic_attention:
                critic.freeze_attention(cfg.critic_trained_layers)
            self.critic, _ = self._engine(deepspeed, critic, deepspeed_config(cfg, cfg.critic_lr), cfg.critic_lr, cfg,
                                          total_steps and total_steps * cfg.critic_steps)
        self._pending: dict[str, list[_Pending]] = {"policy": [], "critic": []}
        self.policy_version = 0
        if self.rank == 0 and self.world > 1 and not _followers_waiting:
            _followers_waiting.append(True)
            atexit.register(_release_followers)

    @staticmethod
    def _engine(deepspeed, model: torch.nn.Module, ds: dict, lr: float, cfg: TrainerConfig, total_steps):
        """A DeepSpeed engine with our AdamW (or the optimizer the config names) and `trainer.lr_schedule` as a
        LambdaLR on it (DeepSpeed steps it with the optimizer and keeps it in its checkpoints), unless the config
        names a DeepSpeed scheduler."""
        trainable = [p for p in model.parameters() if p.requires_grad]
        backbone = getattr(model, "backbone", model)
        if ds["zero_optimization"]["stage"] == 3 and moe_blocks(backbone):
            # ZeRO-3 gathers a module's weights for its backward from a hook on the gradient of its output, and
            # transformers' fused experts read their [n_experts, ...] weights outside the nn.Linear it patches:
            # with nothing below the first MoE block trainable (the critic's frozen embeddings and attention),
            # that gradient never runs the hook and the experts' backward meets a released weight. The embeddings'
            # output asks for a gradient, which costs one frozen attention layer's input backward.
            backbone.enable_input_require_grads()
        schedule = None if "scheduler" in ds else partial(lr_scheduler, cfg=cfg, total_steps=total_steps)
        if "optimizer" in ds:
            return deepspeed.initialize(model=model, model_parameters=trainable, config=ds, lr_scheduler=schedule)[:2]
        opt = adamw(trainable, lr, cfg)
        return deepspeed.initialize(model=model, optimizer=opt, config=ds, lr_scheduler=schedule)[:2]

    # --- the rank-0-drives protocol -------------------------------------------------------------------

    def _announce(self, op: str, **kwargs) -> None:
        """Rank 0 tells the followers which call comes next, with its arguments."""
        if self.rank == 0 and self.world > 1:
            dist.broadcast_object_list([(op, kwargs)], src=0)

    # --- forward passes --------------------------------------------------------------------------------

    def policy_logprobs(self, batch, temperature: float, grad: bool) -> torch.Tensor:
        rows = Rows.of(batch, top_p=True, actions=True)
        self._announce("_forward", kind="policy", rows=rows, temperature=temperature, grad=grad)
        return self._forward("policy", rows, temperature, grad)

    def critic_values(self, batch, grad: bool) -> torch.Tensor:
        if self.critic is None:
            raise RuntimeError("this trainer was built without a critic (the algorithm needs none)")
        rows = Rows.of(batch, actions=True)
        self._announce("_forward", kind="critic", rows=rows, temperature=1.0, grad=grad)
        return self._forward("critic", rows, 1.0, grad)

    def _shares(self, B: int) -> list[tuple[int, int]]:
        """Each rank's contiguous share lo:hi of B batch rows (empty at the end when B < world)."""
        chunk = -(-B // self.world)
        return [(min(B, r * chunk), min(B, (r + 1) * chunk)) for r in range(self.world)]

    def _parts(self, rows: Rows, shares: list[tuple[int, int]]) -> list[torch.Tensor]:
        """This rank's micro-batches (rows of the whole batch), as many as the rank with the most has: forwards and
        backwards are collective (ZeRO-3's gathers, ZeRO-2's reductions), so a rank with fewer adds empty ones."""
        counts, mine = [], []
        for r, (lo, hi) in enumerate(shares):
            parts = [lo + part for part in split(Rows(rows.input_ids[lo:hi], rows.attention_mask[lo:hi]), self.cfg)
                     ] if hi > lo else []
            counts.append(len(parts))
            mine = parts if r == self.rank else mine
        return mine + [torch.zeros(0, dtype=torch.long)] * (max(counts) - len(mine))

    def _forward(self, kind: str, rows: Rows, temperature: float, grad: bool) -> Optional[torch.Tensor]:
        """This rank's contiguous share of the rows, in micro-batches, gathered into the full [B, T] tensor on rank
        0."""
        B, T = rows.input_ids.shape
        shares = self._shares(B)
        lo, hi = shares[self.rank]
        engine = self.policy if kind == "policy" else self.critic

        def forward(part, _):  # an empty part (a rank with fewer micro-batches) runs on a row, keeps no output
            r = rows.take(part if len(part) else torch.zeros(1, dtype=torch.long), self.device)
            if kind == "policy":  # scored at the action tokens only, the ones every caller reads
                out = sequence_logprobs(engine, r.input_ids, r.attention_mask, temperature, top_p=r.top_p,
                                        full_logits=self.zero3, only=r.action_mask)
            else:
                out = engine(r.input_ids, r.attention_mask, r.action_mask)  # at the action tokens, as the policy
            return (widen(out, T)[:len(part)],)

        parts = self._parts(rows, shares)
        local, deferred = micro_forward(forward, parts, [part - lo for part in parts], hi - lo, grad,
                                        keep_graph=len(parts) == 1)
        return self._output(kind, local, lo, [h - l for l, h in shares], deferred, grad)[0]

    def _output(self, kind: str, local: Outputs, lo: int, counts: list[int], deferred: Optional[Deferred],
                grad: bool) -> list[Optional[torch.Tensor]]:
        """Every rank's `local` rows (rank r's: counts[r] rows, starting at row `lo` of the whole) gathered on rank
        0 as leaves; with grad, the outputs wait for the next step of `kind`."""
        wholes = [self._gather(x.detach(), counts, tuple(x.shape[1:])) for x in local]
        leaves = [w.clone().requires_grad_(grad) if self.rank == 0 else None for w in wholes]  # rank 0's loss
        if grad:
            self._pending[kind].append(_Pending(local, lo, [tuple(w.shape) for w in wholes], leaves, deferred))
        return leaves

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
                                top_k: int, vocab_size=None) -> SupportLogprobs:
        """Each rank computes the action rows of its share of the trajectories (it receives only those rows of the
        support); rank 0 gets the whole outputs, the log-probs and the tail as leaves for `step_policy`. Under ZeRO-3
        they come from the model's own forward's logits (its lm head weight exists only inside that forward)."""
        rows = Rows.of(batch, actions=True)
        self._announce("_support_forward", rows=rows, whole_vocab=support_ids is None, vocab_chunk=vocab_chunk,
                       top_k=top_k, vocab_size=vocab_size)
        return self._support_forward(rows, support_ids is None, vocab_chunk, top_k, (support_ids, support_mask),
                                     vocab_size)

    def _support_forward(self, rows: Rows, whole_vocab: bool, vocab_chunk: int, top_k: int,
                         support: tuple = (None, None), vocab_size=None) -> SupportLogprobs:
        starts = rows.action_rows()
        shares = self._shares(len(rows))
        row_shares = [(int(starts[lo]), int(starts[hi])) for lo, hi in shares]  # each share's action rows
        ids, mask = support
        if not whole_vocab and self.world > 1:  # each rank receives its rows of the support only
            parts = [(ids[a:b].cpu(), mask[a:b].cpu()) for a, b in row_shares] if self.rank == 0 else None
            box = [None]
            dist.scatter_object_list(box, parts, src=0)
            ids, mask = box[0]
        if not whole_vocab:
            ids, mask = ids.to(self.device), mask.to(self.device)
        r_lo = row_shares[self.rank][0]

        def forward(part, where):
            r = rows.take(part if len(part) else torch.zeros(1, dtype=torch.long), self.device)
            action = r.action_mask if len(part) else torch.zeros_like(r.action_mask)  # an empty part: no rows, but
            # a backward (of zeros) through every weight all the same, as ZeRO expects
            sub = (None, None) if whole_vocab else (ids[where.to(ids.device)], mask[where.to(mask.device)])
            logp, tail, top = action_support_logprobs(self.policy.module, r.input_ids, r.attention_mask, action, *sub,
                                                      vocab_chunk=vocab_chunk, top_k=top_k, full_logits=self.zero3,
                                                      vocab_size=vocab_size)
            return (logp, tail) if top is None else (logp, tail, top)

        parts = self._parts(rows, shares)
        out_rows = [rows_ - r_lo for rows_ in action_rows_of(rows, parts)]
        local, deferred = micro_forward(forward, parts, out_rows, row_shares[self.rank][1] - r_lo, True,
                                        keep_graph=len(parts) == 1)
        counts = [b - a for a, b in row_shares]
        logp, tail = self._output("policy", local[:2], r_lo, counts, deferred, grad=True)
        top = self._gather(local[2], counts, tuple(local[2].shape[1:])) if len(local) > 2 else None
        return logp, tail, top

    # --- updates ---------------------------------------------------------------------------------------

    def step_policy(self, loss: Optional[torch.Tensor]) -> float:
        norm = self._step("policy", loss)
        self.policy_version += 1
        return norm

    def step_critic(self, loss: Optional[torch.Tensor]) -> float:
        return self._step("critic", loss)

    def _step(self, kind: str, loss: Optional[torch.Tensor]) -> float:
        """Back-propagate the loss through every grad=True forward of `kind` since the last step (those that ran in
        micro-batches: one backward per micro-batch, gradients accumulated); one optimizer step."""
        if loss is not None:  # rank 0's loss, refused before any rank steps
            require_finite(f"{kind} loss", loss)
        self._announce(f"step_{kind}", loss=None)
        pending, self._pending[kind] = self._pending[kind], []
        if not pending:
            raise RuntimeError(f"step_{kind} needs a {kind} forward with grad=True first")
        shapes = [shape for p in pending for shape in p.shapes]
        dtypes = [torch.promote_types(x.dtype, torch.float32) for p in pending for x in p.local]  # as sent
        if self.rank == 0:
            grads = torch.autograd.grad(loss, [leaf for p in pending for leaf in p.leaves], allow_unused=True)
            grads = [torch.zeros(shape, dtype=dtype, device=self.device) if g is None
                     else g.to(self.device, dtype).contiguous() for shape, dtype, g in zip(shapes, dtypes, grads)]
        else:
            grads = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in zip(shapes, dtypes)]
        if self.world > 1:
            for grad in grads:
                dist.broadcast(grad, src=0)
        shares, first = [], 0
        for p in pending:
            shares.append(p.grad_shares(grads[first:first + len(p.shapes)]))
            first += len(p.shapes)
        # DeepSpeed averages gradients over ranks; the sum over ranks is the loss's gradient. Every rank runs the
        # same number of backwards (the kept graphs' together, then one per micro-batch), the last one the
        # accumulation boundary, where ZeRO reduces.
        live = [sum((x * g).sum() for x, g in zip(p.local, share)) for p, share in zip(pending, shares)
                if p.deferred is None]
        backwards = [iter([sum(live)])] if live else []
        backwards += [p.deferred.surrogates(share) for p, share in zip(pending, shares) if p.deferred is not None]
        count = (1 if live else 0) + sum(len(p.deferred.rows) for p in pending if p.deferred is not None)
        engine = self.policy if kind == "policy" else self.critic
        done = 0
        for surrogates in backwards:
            for surrogate in surrogates:
                done += 1
                engine.set_gradient_accumulation_boundary(done == count)
                engine.backward(surrogate * self.world)
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

    def nonfinite_weights(self) -> list[str]:
        """Every rank checks the weights it holds (its partition under ZeRO-3); rank 0 gets the union."""
        self._announce("_nonfinite_shards")
        return self._nonfinite_shards()

    def _nonfinite_shards(self) -> list[str]:
        bad = [f"{kind}.{name}" for kind, engine in (("policy", self.policy), ("critic", self.critic))
               if engine is not None for name, p in engine.module.named_parameters()
               if not bool(torch.isfinite(getattr(p, "ds_tensor", p).detach()).all())]
        if self.world > 1:
            every = [None] * self.world
            dist.all_gather_object(every, bad)
            bad = sorted({name for names in every for name in names})
        return bad

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
            critic = ValueModel.from_pretrained(self.critic_source, weights_dtype(self.cfg))
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
        raise UsageError(f"launched as rank {os.environ.get('RANK')} of a multi-process run, but no stage uses "
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
                                       with_critic=kwargs["with_critic"], critic_from=kwargs["critic_from"],
                                       attn_implementation=kwargs["attn_implementation"],
                                       total_steps=kwargs["total_steps"])
        else:
            getattr(trainer, op)(**kwargs)
