"""Build ``TeacherRecord``s from a teacher's dense log-probabilities.

``logp_rows`` is [n, vocab] normalised log-probabilities (log_softmax output) of one trajectory's action
positions, as a torch tensor on any device or a numpy array; selection runs where the rows live and only
the kept support is copied to host memory. ``sampled_ids`` [n] are the tokens the student sampled.
"""

from __future__ import annotations

import numpy as np
import torch

from .records import CacheMeta, TeacherRecord

TOP_P_PROBE = 256  # nuclei are found among each row's top 256 tokens; rows whose nucleus is larger get a full sort


def _rows(logp_rows) -> torch.Tensor:
    rows = torch.as_tensor(logp_rows)
    if rows.ndim != 2:
        raise ValueError(f"logp_rows must be [n, vocab], got shape {tuple(rows.shape)}")
    return rows


def _sampled_logp(rows: torch.Tensor, sampled_ids) -> np.ndarray:
    index = torch.as_tensor(sampled_ids, dtype=torch.long, device=rows.device).reshape(-1, 1)
    return rows.gather(1, index)[:, 0].float().cpu().numpy()


def _support_record(rows: torch.Tensor, sampled_ids, row_index: torch.Tensor, ids: torch.Tensor) -> TeacherRecord:
    """Record keeping token ``ids[j]`` at position ``row_index[j]``; the rest of each row becomes its tail."""
    n, vocab = rows.shape
    order = torch.argsort(row_index * vocab + ids)  # positions in order, ids ascending within each
    row_index, ids = row_index[order], ids[order]
    probs = rows.float().exp()
    total = probs.sum(-1)
    probs[row_index, ids] = 0.0
    tail = probs.sum(-1) / total  # summed directly, so tiny tails keep their relative precision
    row_len = torch.bincount(row_index, minlength=n)
    offsets = torch.cat([row_len.new_zeros(1), row_len.cumsum(0)])
    return TeacherRecord(
        sampled_logp=_sampled_logp(rows, sampled_ids),
        ids=ids.cpu().numpy().astype(np.int64),
        logp=rows[row_index, ids].float().cpu().numpy(),
        offsets=offsets.cpu().numpy().astype(np.int64),
        tail_mass=tail.clamp(0.0, 1.0).cpu().numpy(),
    )


def encode_top_k(logp_rows, k: int, sampled_ids) -> TeacherRecord:
    """Keep the k most probable tokens of every position."""
    rows = _rows(logp_rows)
    ids = rows.topk(k, dim=-1).indices
    row_index = torch.arange(rows.shape[0], device=rows.device).repeat_interleave(k)
    return _support_record(rows, sampled_ids, row_index, ids.reshape(-1))


def _nucleus(values: torch.Tensor, ids: torch.Tensor, row_index: torch.Tensor, p: float):
    """(row, id) pairs of the shortest prefix of each descending row whose probability reaches p."""
    cumulative = values.double().exp().cumsum(-1)
    size = ((cumulative < p).sum(-1) + 1).clamp(max=values.shape[-1])
    keep = torch.arange(values.shape[-1], device=values.device) < size[:, None]
    return row_index[:, None].expand_as(ids)[keep], ids[keep]


def encode_top_p(logp_rows, p: float, sampled_ids) -> TeacherRecord:
    """Keep each position's nucleus: the fewest most probable tokens holding at least probability p."""
    rows = _rows(logp_rows)
    values, ids = rows.topk(min(rows.shape[1], TOP_P_PROBE), dim=-1)
    covered = values.double().exp().sum(-1) >= p
    row_numbers = torch.arange(rows.shape[0], device=rows.device)
    parts = [_nucleus(values[covered], ids[covered], row_numbers[covered], p)]
    if not bool(covered.all()):
        values, ids = rows[~covered].sort(dim=-1, descending=True)
        parts.append(_nucleus(values, ids, row_numbers[~covered], p))
    return _support_record(rows, sampled_ids, torch.cat([r for r, _ in parts]), torch.cat([i for _, i in parts]))


def encode_full(logp_rows, sampled_ids) -> TeacherRecord:
    rows = _rows(logp_rows)
    return TeacherRecord(sampled_logp=_sampled_logp(rows, sampled_ids), logp=rows.float().cpu().numpy())


def record_from_logprobs(meta: CacheMeta, logp_rows, sampled_ids) -> TeacherRecord:
    """The record ``meta.granularity`` asks for; what a teacher scorer calls per trajectory."""
    if meta.granularity == "top_k":
        return encode_top_k(logp_rows, meta.k, sampled_ids)
    if meta.granularity == "top_p":
        return encode_top_p(logp_rows, meta.p, sampled_ids)
    if meta.granularity == "full":
        return encode_full(logp_rows, sampled_ids)
    return TeacherRecord(sampled_logp=_sampled_logp(_rows(logp_rows), sampled_ids))
