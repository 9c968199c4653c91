"""Build ``TeacherRecord``s from a teacher's dense log-probabilities.

``logp_rows`` is [n, vocab] normalised log-probabilities (log_softmax output) of one trajectory's action
positions, as a torch tensor on any device or a numpy array; selection runs where the rows live and only
the kept support is copied to host memory. ``sampled_ids`` [n] are the tokens the student sampled.
"""

from __future__ import annotations

import numpy as np
import torch

from .records import CacheMeta, TeacherRecord


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


def capped_nucleus_size(logp_desc: torch.Tensor, p: float, max_support: int) -> torch.Tensor:
    """[n] support size of each row's capped top-p nucleus: the shortest prefix of the row's most probable
    tokens whose probability reaches p, cut to at most ``max_support`` ids (the rest of the nucleus then
    joins the tail bucket), so bytes per token stay bounded whatever the teacher's entropy.

    ``logp_desc`` [n, w]: normalised log-probs sorted descending, at least the top min(max_support, vocab)
    of each row (the capped nucleus never reaches further). The one definition teacher scoring
    (opd_sao.teachers.scoring) and the dense encoder below share.
    """
    cumulative = logp_desc.double().exp().cumsum(-1)
    return ((cumulative < p).sum(-1) + 1).clamp(max=min(max_support, logp_desc.shape[-1]))


def nucleus_cut(row_len: torch.Tensor, tail_mass: torch.Tensor, p: float, max_support: int) -> torch.Tensor:
    """[n] bool: positions whose nucleus the cap cut (the support is full and still holds less than p)."""
    return (row_len >= max_support) & (1.0 - tail_mass.double() < p)


def encode_top_p(logp_rows, p: float, sampled_ids, max_support: int) -> TeacherRecord:
    """Keep each position's nucleus (the fewest most probable tokens holding at least probability p), at most
    ``max_support`` of them."""
    rows = _rows(logp_rows)
    values, ids = rows.topk(min(rows.shape[1], max_support), dim=-1)
    size = capped_nucleus_size(values, p, max_support)
    keep = torch.arange(values.shape[-1], device=values.device) < size[:, None]
    row_index = torch.arange(rows.shape[0], device=rows.device)[:, None].expand_as(ids)
    return _support_record(rows, sampled_ids, row_index[keep], ids[keep])


def encode_full(logp_rows, sampled_ids) -> TeacherRecord:
    rows = _rows(logp_rows)
    return TeacherRecord(sampled_logp=_sampled_logp(rows, sampled_ids), logp=rows.float().cpu().numpy())


def record_from_logprobs(meta: CacheMeta, logp_rows, sampled_ids) -> TeacherRecord:
    """The record ``meta.granularity`` asks for; what a teacher scorer calls per trajectory."""
    if meta.granularity == "top_k":
        return encode_top_k(logp_rows, meta.k, sampled_ids)
    if meta.granularity == "top_p":
        return encode_top_p(logp_rows, meta.p, sampled_ids, meta.max_support)
    if meta.granularity == "full":
        return encode_full(logp_rows, sampled_ids)
    return TeacherRecord(sampled_logp=_sampled_logp(_rows(logp_rows), sampled_ids))
