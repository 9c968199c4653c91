"""The OPD learning step (docs/design.md §4): losses from cached teacher outputs on the student's own rollouts.

`OPDLearner.step(batch)` is what `RLLoop` calls in an OPD stage (it is Learner-shaped: `backend`,
`step`, `state`, `restore`). It gets each trajectory's teacher record through `TeacherTargets` (scored
if missing and quantised in memory as the cache stores it, committed to the logit cache beside the step; read
back from the cache when seen before) and then, per the teacher's granularity:

* `sampled`: the per-token reverse-KL advantage `-(logp_student - logp_teacher)` on the sampled token
  (optionally plus `reward_weight` x (task reward - running mean)), through the SAO policy loss, so
  tokens whose student/rollout ratio left the DIS band are masked exactly as in SAO.
* `top_k`, `top_p`: `truncated_divergence` between teacher and student on the teacher's stored support
  plus one tail bucket (the stored tail mass; the student's tail is summed exactly over the logits
  outside the support), forward KL, reverse KL or JSD (`opd.divergence`).
* `full`: the same divergence over the whole vocabulary, streamed: student and teacher read together one
  vocabulary chunk at a time (`TrainerBackend.policy_full_divergence`), the teacher's rows kept as the cache's
  one-byte codes (`FullTeacher`), so no [N, V] float tensor exists on either side.

The student's support log-probs come from the trainer backend (`policy_support_logprobs`, as the sampled
path's come from `policy_logprobs`, so OPD trains the same under torch and DeepSpeed): its final hidden
states and the lm head one vocabulary chunk at a time, recomputed in the backward, so neither pass
keeps an [N, V] logits tensor alive.

Temperatures, one choice for every granularity: what is matched is student and teacher at temperature 1 (the
models themselves; teacher records are scored at T = 1). The divergence rows are at T = 1; the sampled path's
advantage `-(logp_student - logp_teacher)` takes both logprobs at T = 1 too (the student's from one more
forward when the rollouts were sampled at another temperature), so a student equal to its teacher gets a zero
advantage at any sampling temperature. Only the DIS ratio and the policy-gradient term use the student's
logprob at the rollout temperature (and top-p): the distribution the engine sampled from, as SAO's do. Every
step reports both (`distill_temperature`, `sampling_temperature`); the gate compares engine and trainer at the
sampling temperature, the only place their logprobs meet.

Padding: divergence rows are over the shared tokenizer's ids (embedding rows past them are padding, masked
on both sides: `TeacherSet.vocab_size`); the sampled path's student logprobs are of its whole distribution (the
one the engine samples from; a padding token the student samples gets the teacher's floor logprob, the cache's
-64 nats).

The loss is a token mean over every action token of the batch: sum of per-token terms / N.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import partial
from typing import Optional

import numpy as np
import torch

from opd_sao import algorithms as A
from opd_sao.cache import nucleus_cut
from opd_sao.cache.encoding import dequantise_logp
from opd_sao.config import AlgoConfig, OPDConfig
from opd_sao.rl.learner import ResumableLearner
from opd_sao.trajectory import Batch

REPORTED_DIVERGENCE = "reverse_kl"  # the `kl` metrics, whatever opd.divergence trains: one scale across runs
DISTILL_TEMPERATURE = 1.0  # student and teacher are matched at this temperature (teacher records are scored at it)

# ----------------------------------------------------------------------------
# teacher records -> padded tensors
# ----------------------------------------------------------------------------

def padded_support(records, device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [N, S], teacher logp [N, S], mask [N, S], tail [N]) from top-k / top-p records, rows in order, on
    `device` (the student's)."""
    lens = np.concatenate([np.diff(r.offsets) for r in records]).astype(np.int64)
    ids = torch.from_numpy(np.concatenate([r.ids for r in records]).astype(np.int64))
    logp = torch.from_numpy(np.concatenate([r.logp for r in records]).astype(np.float32))
    tail = torch.from_numpy(np.concatenate([r.tail_mass for r in records]).astype(np.float32))
    n, width = len(lens), int(lens.max()) if len(lens) else 0
    lens_t = torch.from_numpy(lens)
    row = torch.repeat_interleave(torch.arange(n), lens_t)
    starts = torch.cumsum(lens_t, 0) - lens_t
    col = torch.arange(len(ids)) - torch.repeat_interleave(starts, lens_t)
    ids_pad = torch.zeros((n, width), dtype=torch.long)
    logp_pad = torch.zeros((n, width))
    mask = torch.zeros((n, width), dtype=torch.bool)
    ids_pad[row, col], logp_pad[row, col], mask[row, col] = ids, logp, True
    return ids_pad.to(device), logp_pad.to(device), mask.to(device), tail.to(device)


class FullTeacher:
    """Full-vocabulary teacher rows held as the cache's one-byte codes, one [n, V] array per trajectory (as the
    records hold them: never concatenated, never floats), decoded one vocabulary chunk at a time for
    `TrainerBackend.policy_full_divergence`: log-probs renormalised per row (the decoded levels sum to 1 only up
    to the quantisation), as a log-softmax of the row would."""

    def __init__(self, codes: list[np.ndarray], device):
        self.parts = [torch.from_numpy(np.ascontiguousarray(c)) for c in codes]
        self.first = torch.tensor([0] + [len(c) for c in codes]).cumsum(0)  # each part's first row
        self.levels = torch.from_numpy(dequantise_logp(np.arange(256, dtype=np.uint8))).double()
        counts = torch.cat([torch.zeros((len(c), 256), dtype=torch.float64).scatter_add_(
            1, c.long(), torch.ones(c.shape, dtype=torch.float64)) for c in self.parts])
        self.lse = torch.logsumexp(self.levels + counts.log(), dim=1)  # logsumexp of each row's decoded logprobs
        self.device = device

    def codes(self, rows: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """uint8 [len(rows), end - start]: the codes of (global) rows on vocabulary columns [start, end)."""
        part = torch.searchsorted(self.first, rows, right=True) - 1
        out = torch.empty((len(rows), end - start), dtype=torch.uint8)
        for p in part.unique().tolist():
            sel = part == p
            out[sel] = self.parts[p][rows[sel] - self.first[p], start:end]
        return out

    def __call__(self, rows: torch.Tensor, start: int, end: int) -> torch.Tensor:
        rows = rows.cpu()
        logp = self.levels[self.codes(rows, start, end).long()] - self.lse[rows].unsqueeze(1)
        return logp.float().to(self.device)

    def overlap(self, student_top: torch.Tensor) -> torch.Tensor:
        """`algorithms.topk_overlap` on full rows: the share of the student's top-k ids the teacher ranks in its
        own top k (ties count: a code at most the teacher's k-th smallest)."""
        k = student_top.shape[1]
        kth = torch.cat([c.to(torch.int16).kthvalue(k, dim=1).values for c in self.parts])
        top = student_top.cpu()
        picked = torch.cat([c.gather(1, top[a:b]) for c, a, b in zip(self.parts, self.first, self.first[1:])])
        return (picked.to(torch.int16) <= kth.unsqueeze(1)).float().mean(1).to(student_top.device)


# ----------------------------------------------------------------------------
# which domain the next rollout comes from
# ----------------------------------------------------------------------------

class DomainSchedule:
    """The OPD stage's per-domain schedule: each domain's share of the student's rollouts follows its measured gap
    to its teacher (`algorithms.domain_shares` of the held-out probe scores over the teachers' scores), a domain
    at `target` draws only `min_share`, and `done` says every domain is there.

    Rollouts are dealt by smooth weighted round robin over the shares (deterministic, and every prefix of the
    sequence is within one rollout of its shares); equal shares, before the first probe, are plain round robin.
    `next_domain` runs on the rollout worker's thread, `update` on the trainer's.
    """

    def __init__(self, domains: list[str], target: float, min_share: float = 0.0):
        self.domains, self.target, self.min_share = list(domains), target, min_share
        self.teacher_scores: dict[str, float] = {}
        self.shares = {d: 1.0 / len(self.domains) for d in self.domains}
        self.recovered: dict[str, float] = {}
        self.probes: list[dict] = []
        self.drawn = dict.fromkeys(self.domains, 0)
        self._credit = dict.fromkeys(self.domains, 0.0)
        self._lock = threading.Lock()

    def next_domain(self) -> str:
        with self._lock:
            # every domain done: the stage is ending; rollouts already asked for are dealt round robin
            shares = self.shares if any(self.shares.values()) else dict.fromkeys(self.domains, 1.0)
            for d in self.domains:
                self._credit[d] += shares[d]
            pick = max(self.domains, key=lambda d: round(self._credit[d], 9))  # ties: the first listed
            self._credit[pick] -= sum(shares.values())
            self.drawn[pick] += 1
            return pick

    def update(self, step: int, scores: dict[str, float], teacher_scores: dict[str, float]) -> None:
        """A probe at `step` (policy steps done): held-out scores of the student and of each domain's teacher.
        A teacher scoring 0 leaves nothing to recover (the domain counts as done)."""
        recovered = {d: scores[d] / teacher_scores[d] if teacher_scores[d] > 0 else 1.0 for d in self.domains}
        shares = A.domain_shares(recovered, self.target, self.min_share)
        with self._lock:
            self.teacher_scores, self.recovered, self.shares = dict(teacher_scores), recovered, shares
            self._credit = dict.fromkeys(self.domains, 0.0)
        self.probes.append({"step": step, "scores": {d: round(v, 4) for d, v in scores.items()},
                            "recovered": {d: round(v, 4) for d, v in recovered.items()},
                            "shares": {d: round(v, 4) for d, v in shares.items()}})

    @property
    def done(self) -> bool:
        return bool(self.recovered) and all(r >= self.target for r in self.recovered.values())

    def summary(self) -> dict:
        """For summary.json: the probes, the rollouts each domain drew, the step each first reached the target."""
        reached = {d: next((p["step"] for p in self.probes if p["recovered"][d] >= self.target), None)
                   for d in self.domains}
        return {"target": self.target, "min_share": self.min_share, "teacher_scores": self.teacher_scores, "probes": self.probes,
                "rollouts": dict(self.drawn), "reached_target_at_step": reached,
                "ended": "target" if self.done else "budget"}


# ----------------------------------------------------------------------------
# the learner
# ----------------------------------------------------------------------------

def _mean(x: torch.Tensor) -> float:
    return float(x.mean()) if x.numel() else 0.0


@dataclass
class Rows:
    """An OPD batch as action rows (trajectory order, then position) with each trajectory's teacher record.

    Every tensor lives on the batch's device (the trainer's: RLLoop moves batches there)."""

    batch: Batch
    records: list  # TeacherRecord per trajectory
    granularity: list[str]  # per trajectory, its teacher's
    b: torch.Tensor  # [N] trajectory of each action row
    t: torch.Tensor  # [N] position of each action row
    seq_rewards: torch.Tensor  # [B]

    @classmethod
    def of(cls, batch: Batch, fetched, specs) -> "Rows":
        mask = batch.action_mask.bool()
        for traj, record, n in zip(batch.trajectories, fetched.records, mask.sum(1).tolist()):
            if record.n_positions != n:
                raise RuntimeError(f"teacher record for {traj.traj_id} has {record.n_positions} positions, "
                                   f"the trajectory {n} action tokens")
        b, t = mask.nonzero(as_tuple=True)
        return cls(batch, fetched.records, [specs[name].granularity for name in fetched.teachers], b, t,
                   batch.rewards.sum(-1))

    @property
    def n(self) -> int:
        return max(1, len(self.b))

    @property
    def device(self) -> torch.device:
        return self.b.device

    def trajectories_with(self, *granularities: str) -> torch.Tensor:
        """[B] bool: trajectories whose teacher stores one of these granularities."""
        return torch.tensor([g in granularities for g in self.granularity], dtype=torch.bool, device=self.device)

    def teacher_sampled(self) -> torch.Tensor:
        """[B, T] the teacher's logprob of each sampled action token (0 elsewhere)."""
        out = torch.zeros(self.batch.action_mask.shape, device=self.device)
        if len(self.b):
            out[self.b, self.t] = torch.from_numpy(
                np.concatenate([r.sampled_logp for r in self.records]).astype(np.float32)).to(self.device)
        return out


@dataclass
class RowStats:
    """Per action row: what the metrics report (NaN where a row's granularity does not define it)."""

    kl: torch.Tensor  # the reverse-KL estimate (k1 on the sampled token, exact on a support)
    mass: torch.Tensor  # teacher mass covered by the stored support
    overlap: torch.Tensor  # top-k overlap of student and teacher

    @classmethod
    def empty(cls, n: int, device: torch.device) -> "RowStats":
        nan = torch.full((n,), float("nan"), device=device)
        return cls(torch.zeros(n, device=device), nan, nan.clone())


class OPDLearner(ResumableLearner):
    def __init__(self, backend, opd: OPDConfig, sao: AlgoConfig, targets, *, overlap_k: Optional[int] = None,
                 timer=None):
        super().__init__(sao.baseline_window, timer)
        self.backend, self.opd, self.sao, self.targets = backend, opd, sao, targets
        self.overlap_k = overlap_k or opd.top_k
        # the trained divergence is the reported one: its values are the `kl` metrics, no second pass
        self._trains_reported = A.DIVERGENCES.get(opd.divergence) is A.DIVERGENCES.get(REPORTED_DIVERGENCE)

    def state(self) -> dict:
        """Resumable state; the records trained on so far are committed to the cache first, so a resume finds
        every one it was acknowledged (a crash before this loses only the records since the last save)."""
        self.targets.flush()
        return super().state()

    def step(self, batch: Batch, temperature: float) -> dict:
        with self.timer.phase("teacher"):  # cache reads, teacher scoring and prefetch stalls
            fetched = self.targets.fetch(batch.trajectories)
        with self.timer.phase("policy"):
            return self._train(batch, temperature, fetched)

    def _train(self, batch: Batch, temperature: float, fetched) -> dict:
        rows = Rows.of(batch, fetched, self.targets.registry.specs)
        stats = RowStats.empty(len(rows.b), rows.device)
        metrics: dict = {"reward_mean": float(rows.seq_rewards.mean()), "batch_size": float(len(batch.trajectories)),
                         "distill_temperature": DISTILL_TEMPERATURE, "sampling_temperature": float(temperature)}
        loss = torch.zeros((), device=rows.device)
        if bool(rows.trajectories_with("sampled").any()) or self.opd.reward_weight > 0:
            loss = loss + self._policy_gradient(rows, temperature, stats, metrics)
        if bool(rows.trajectories_with("top_k", "top_p", "full").any()):
            loss = loss + self._divergence(rows, stats, metrics)
        metrics["policy_grad_norm"] = self.backend.step_policy(loss)
        metrics["policy_loss"] = float(loss.detach())
        self.baseline.update(rows.seq_rewards)
        self.steps_done += 1
        self._report(metrics, fetched, rows, stats)
        return metrics

    def _policy_gradient(self, rows: Rows, temperature: float, stats: RowStats, metrics: dict) -> torch.Tensor:
        """The sampled-token reverse-KL advantage (plus the task reward when mixed in) through the DIS loss."""
        batch = rows.batch
        mask = batch.action_mask.bool()
        sampled_mask = mask & rows.trajectories_with("sampled").unsqueeze(1)
        pg_mask = mask if self.opd.reward_weight > 0 else sampled_mask
        teacher_sampled = rows.teacher_sampled()
        logp = self.backend.policy_logprobs(batch, temperature, grad=True)  # the sampled distribution: ratio, gradient
        matched = logp if temperature == DISTILL_TEMPERATURE else \
            self.backend.policy_logprobs(batch, DISTILL_TEMPERATURE, grad=False)  # the teacher's temperature
        advantages = A.reverse_kl_advantage(matched, teacher_sampled, sampled_mask)
        if self.opd.reward_weight > 0:
            reward_adv = A.broadcast_sequence_advantage(rows.seq_rewards - self.baseline.value, mask)
            advantages = advantages + self.opd.reward_weight * reward_adv
        pg_loss, pg_metrics = A.sao_policy_loss(logp, batch.rollout_logp, advantages, pg_mask,
                                                self.sao.eps_low, self.sao.eps_high)
        # DIS masking per token age (versions between the sampling weights and these, before this update), as the
        # RL learner reports it: with partial rollouts one trajectory holds tokens of several ages
        _, keep = A.dis_weights(logp.detach(), batch.rollout_logp, self.sao.eps_low, self.sao.eps_high)
        metrics.update(A.mask_fraction_by_age(keep, pg_mask, self.backend.policy_version - batch.versions))
        on_sampled = sampled_mask[rows.b, rows.t]
        stats.kl[on_sampled] = (matched.detach() - teacher_sampled)[rows.b, rows.t][on_sampled].float()  # k1 estimator
        metrics.update(mask_fraction=pg_metrics["mask_fraction"], ratio_mean=pg_metrics["ratio_mean"],
                       adv_mean=float(advantages[pg_mask].mean()) if pg_mask.any() else 0.0,
                       adv_std=float(advantages[pg_mask].std()) if pg_mask.sum() > 1 else 0.0)
        return pg_loss * (float(pg_mask.sum()) / rows.n)

    def _divergence(self, rows: Rows, stats: RowStats, metrics: dict) -> torch.Tensor:
        """The divergence between student and teacher per granularity: on the stored support plus the tail bucket
        (top_k, top_p), or over the whole vocabulary, streamed (full)."""
        dev = rows.device
        total = torch.zeros((), device=dev)
        div_sum, div_rows = 0.0, 0
        vocab = self.targets.registry.vocab_size  # the teachers' scored ids: the student's padded rows masked too
        for gran in ("top_k", "top_p", "full"):
            traj_sel = rows.trajectories_with(gran)
            if not bool(traj_sel.any()):
                continue
            sel = traj_sel[rows.b]
            sub = rows.batch.select(traj_sel)
            recs = [rows.records[i] for i in traj_sel.nonzero().squeeze(1).tolist()]
            if gran == "full":
                div, rkl, overlap = self._full_divergence(sub, recs, vocab)
                mass, size = torch.ones(len(div), device=dev), float(vocab)
            else:
                div, rkl, overlap, mass, size = self._support_divergence(sub, recs, vocab, gran, metrics)
            total = total + div.sum() / rows.n
            div_sum, div_rows = div_sum + float(div.detach().sum()), div_rows + len(div)
            stats.kl[sel] = (div.detach() if rkl is None else rkl).float()
            stats.mass[sel] = mass.float()
            stats.overlap[sel] = overlap
            metrics[f"support_size_{gran}"] = size
        metrics["divergence"] = div_sum / max(1, div_rows)
        return total

    def _support_divergence(self, sub: Batch, records, vocab: int, gran: str, metrics: dict):
        """The divergence on each row's stored support plus the tail bucket: (divergence [N], reverse KL [N] (no
        grad), top-k overlap [N], teacher mass on the support [N], mean support size)."""
        opd, dev = self.opd, self.backend.device
        ids, t_raw, support, tail = padded_support(records, dev)
        t_logp = A.renormalize_support(t_raw, support, tail)
        s_logp, s_tail, top_ids = self.backend.policy_support_logprobs(
            sub, ids, support, vocab_chunk=opd.vocab_chunk, top_k=self.overlap_k, vocab_size=vocab)
        if gran == "top_p":  # the share of positions whose nucleus opd.max_support cut
            cut = nucleus_cut(support.sum(1), tail, opd.top_p, opd.max_support)
            metrics["nucleus_cap_hit_rate"] = float(cut.float().mean())
        div = A.truncated_divergence(s_logp, t_logp, support, s_tail, kind=opd.divergence, beta=opd.jsd_beta)
        with torch.no_grad():
            rkl = None if self._trains_reported else A.truncated_divergence(
                s_logp.detach(), t_logp, support, s_tail.detach(), kind=REPORTED_DIVERGENCE)
            overlap = A.topk_overlap(top_ids, t_logp, ids, support, self.overlap_k)
        return div, rkl, overlap, 1.0 - tail, float(support.sum(1).float().mean())

    def _full_divergence(self, sub: Batch, records, vocab: int):
        """The divergence over the whole vocabulary, student and teacher streamed together chunk by chunk (the
        teacher's rows stay the cache's one-byte codes): (divergence [N], reverse KL [N], top-k overlap [N])."""
        opd, dev = self.opd, self.backend.device
        teacher = FullTeacher([r.logp_codes for r in records], dev)
        terms = partial(A.pointwise_divergence, kind=opd.divergence, beta=opd.jsd_beta)
        report = None if self._trains_reported else partial(A.pointwise_divergence, kind=REPORTED_DIVERGENCE)
        div, rkl, top_ids = self.backend.policy_full_divergence(sub, teacher, terms, report=report,
                                                                vocab_chunk=opd.vocab_chunk, top_k=self.overlap_k,
                                                                vocab_size=vocab)
        return div, None if report is None else rkl, teacher.overlap(top_ids)

    def _report(self, metrics: dict, fetched, rows: Rows, stats: RowStats) -> None:
        trajs = rows.batch.trajectories
        metrics["kl"] = _mean(stats.kl)
        teacher_of_row = [fetched.teachers[i] for i in rows.b.tolist()]
        domain_of_row = [trajs[i].domain for i in rows.b.tolist()]
        for key, labels in (("kl_teacher", teacher_of_row), ("kl_domain", domain_of_row)):
            for label in sorted(set(labels)):
                sel = torch.tensor([x == label for x in labels], dtype=torch.bool, device=rows.device)
                metrics[f"{key}/{label}"] = _mean(stats.kl[sel])
        finite = ~stats.mass.isnan()
        if bool(finite.any()):
            metrics["support_mass"] = _mean(stats.mass[finite])
            for label in sorted(set(teacher_of_row)):
                sel = finite & torch.tensor([x == label for x in teacher_of_row], dtype=torch.bool, device=rows.device)
                if bool(sel.any()):
                    metrics[f"support_mass/{label}"] = _mean(stats.mass[sel])
            metrics["topk_overlap"] = _mean(stats.overlap[~stats.overlap.isnan()])
        for domain in sorted({t.domain for t in trajs}):
            sel = torch.tensor([t.domain == domain for t in trajs], dtype=torch.bool, device=rows.device)
            metrics[f"reward_domain/{domain}"] = _mean(rows.seq_rewards[sel])
        prefetch = self.targets.prefetcher.stats
        metrics.update(
            cache_hit_rate=fetched.hit_rate, cache_hits=fetched.hits, cache_misses=fetched.misses,
            corrupt_rescored=fetched.corrupt_rescored, prefetch_stall_s=fetched.stall_s,
            prefetch_stall_total_s=prefetch["stall_s"], teacher_score_s=fetched.score_s,
            cache_write_s=fetched.cache_write_s, cache_read_s=fetched.cache_read_s,
            teacher_loads=prefetch["loads"], teacher_evictions=prefetch["evictions"], teacher_copies=prefetch["copies"],
        )
