"""Teacher outputs from final hidden states, one vocabulary chunk at a time.

A teacher scores a student trajectory by one forward pass to its final hidden states; the lm head is
then applied to the action rows only, `row_block` rows by `vocab_chunk` columns at a time, so peak memory
is row_block x vocab_chunk floats however long the sequences and however large the vocabulary (the
`full` granularity's output is [n, V] by definition: one byte per entry, the logit cache's code of the
logprob, written chunk by chunk in a second pass once the row's logsumexp is known).

One pass over the chunks gives, per row: the logit of the sampled token and, for truncated supports, a
running candidate set (`modeling.RunningTopK`: the top-k, or the top `max_support` tokens for top-p: the
capped nucleus never reaches further, `cache.capped_nucleus_size`) plus the logsumexp of every logit
outside it (`rest`: each chunk's entries that did not enter the candidates (`_rest`), and the candidates a
cut evicted). The logsumexp of all logits is rest + the candidates', so the tail mass is summed from the
logits outside the support (exp(rest - lse)), never computed as 1 - kept, and a tiny tail keeps its
relative precision.

Output layout is the logit cache's `TeacherRecord`: support ids ascending within each position, offsets
per position, logprobs, tail mass, and the sampled token's logprob at every granularity.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from opd_sao.cache import TeacherRecord, capped_nucleus_size
from opd_sao.cache.encoding import quantise_logp
from opd_sao.model.modeling import MASKED, ROW_BLOCK, VOCAB_CHUNK, RunningTopK, fused_logsumexp, logit_chunks

NEG_INF = float("-inf")


@dataclass
class ScoredRows:
    """Teacher outputs for N action rows (all trajectories of a batch, in order)."""

    sampled_logp: torch.Tensor  # float32 [N]
    ids: Optional[torch.Tensor] = None  # int64 [total] ascending within each row (top_k, top_p)
    logp: Optional[torch.Tensor] = None  # float32 [total] (top_k, top_p)
    row_len: Optional[torch.Tensor] = None  # int64 [N] (top_k, top_p)
    tail_mass: Optional[torch.Tensor] = None  # float32 [N] (top_k, top_p)
    logp_codes: Optional[torch.Tensor] = None  # uint8 [N, V] (full): the logit cache's codes of -logp

    def split(self, counts: list[int]) -> list[TeacherRecord]:
        """One record per trajectory; counts = action rows of each trajectory."""
        records, row, flat = [], 0, 0
        sampled_all = self.sampled_logp.numpy().astype(np.float32)  # converted once; a record holds copies
        if self.row_len is not None:
            lens_all = self.row_len.numpy().astype(np.int64)
            ids_all, logp_all = self.ids.numpy().astype(np.int64), self.logp.numpy().astype(np.float32)
            tail_all = self.tail_mass.numpy().astype(np.float32)
        for n in counts:
            sampled = sampled_all[row:row + n].copy()
            if self.row_len is not None:
                offsets = np.zeros(n + 1, dtype=np.int64)
                np.cumsum(lens_all[row:row + n], out=offsets[1:])
                total = int(offsets[-1])
                records.append(TeacherRecord(
                    sampled_logp=sampled, ids=ids_all[flat:flat + total].copy(),
                    logp=logp_all[flat:flat + total].copy(), offsets=offsets, tail_mass=tail_all[row:row + n].copy()))
                flat += total
            elif self.logp_codes is not None:
                records.append(TeacherRecord(sampled_logp=sampled, logp_codes=self.logp_codes[row:row + n].numpy()))
            else:
                records.append(TeacherRecord(sampled_logp=sampled))
            row += n
        return records


def _rest(logits: torch.Tensor, r: torch.Tensor, c: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """logsumexp of each row's logits except the entries (r, c) of values v (the candidates), from those logits.

    Where the candidates hold at most half of the chunk's mass, it is the chunk's logsumexp plus log(1 - their
    share), which loses at most a bit (no full masked pass); elsewhere the other logits are summed directly."""
    lse = fused_logsumexp(logits)
    share = torch.bincount(r, weights=(v - lse[r]).double().exp(), minlength=len(lse))
    rest = lse + torch.log1p(-share.clamp(max=0.5)).to(lse.dtype)
    heavy = (share > 0.5).nonzero().squeeze(1)
    if len(heavy):
        masked = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        masked[r, c] = True
        rest[heavy] = fused_logsumexp(logits[heavy].masked_fill_(masked[heavy], MASKED))
    return rest


@torch.no_grad()
def score_rows(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor, *,
               granularity: str, k: Optional[int] = None, p: Optional[float] = None, max_support: Optional[int] = None,
               vocab_chunk: int = VOCAB_CHUNK, row_block: int = ROW_BLOCK) -> ScoredRows:
    """Teacher outputs for hidden [N, H] (the state before each action token) and the sampled targets [N].

    Logprobs are of softmax(hidden @ weight.T + bias) at temperature 1, in float32.
    """
    if granularity not in ("sampled", "top_k", "top_p", "full"):
        raise ValueError(f"unknown granularity {granularity!r}")
    n, vocab = hidden.shape[0], weight.shape[0]
    hidden = hidden.to(weight.dtype)
    if granularity == "top_k" and not (k and 1 <= k <= vocab):
        raise ValueError(f"top_k needs 1 <= k <= vocab size {vocab}, got {k}")
    if granularity == "top_p" and not (p and 0 < p <= 1 and max_support and max_support >= 1):
        raise ValueError(f"top_p needs 0 < p <= 1 and max_support >= 1, got p={p}, max_support={max_support}")
    keep = {"top_k": k, "top_p": min(max_support or 0, vocab)}.get(granularity)
    dev = hidden.device
    sampled = torch.empty(n, dtype=torch.float32, device=dev)
    full = np.empty((n, vocab), dtype=np.uint8) if granularity == "full" else None
    ids_out, logp_out, len_out, tail_out = [], [], [], []
    for first in range(0, n, row_block):
        h, t = hidden[first:first + row_block], targets[first:first + row_block]
        rows = h.shape[0]
        picked = torch.full((rows,), NEG_INF, device=dev)  # a target past the vocabulary (padding): no mass
        rest = torch.full((rows,), NEG_INF, device=dev)  # logsumexp of every logit outside the candidates
        top = RunningTopK(rows, keep, rest) if keep else None
        for start, logits in logit_chunks(h, weight, bias, vocab_chunk):
            inside = (t >= start) & (t < start + logits.shape[1])
            picked[inside] = logits[inside, t[inside] - start]
            outside = fused_logsumexp(logits) if top is None else _rest(logits, *top.add(logits, start))
            rest = torch.logaddexp(rest, outside)
        if top is not None:
            cand_vals, cand_ids = top.result()
            rest = torch.logaddexp(rest, top.evicted)
            lse = torch.logaddexp(rest, torch.logsumexp(cand_vals, dim=1))
        else:
            lse = rest
        sampled[first:first + rows] = picked - lse
        if full is not None:  # a second pass, coding each chunk as the cache stores it: no [N, V] floats
            for start, logits in logit_chunks(h, weight, bias, vocab_chunk):
                logp = logits.sub_(lse.unsqueeze(1)).cpu().numpy()
                full[first:first + rows, start:start + logits.shape[1]] = quantise_logp(logp)
        elif granularity == "top_k":
            order = cand_ids.argsort(dim=1)
            ids_out.append(cand_ids.gather(1, order).reshape(-1))
            logp_out.append((cand_vals.gather(1, order) - lse.unsqueeze(1)).reshape(-1))
            len_out.append(torch.full((rows,), k, dtype=torch.long, device=dev))
            tail_out.append((rest - lse).exp())
        elif granularity == "top_p":
            parts = nucleus_rows(lse, cand_vals, cand_ids, rest, p, max_support)
            for out, part in zip((ids_out, logp_out, len_out, tail_out), parts):
                out.append(part)
    sampled = sampled.cpu()
    if full is not None:
        return ScoredRows(sampled_logp=sampled, logp_codes=torch.from_numpy(full))
    if granularity == "sampled":
        return ScoredRows(sampled_logp=sampled)
    cat = lambda xs, dtype: torch.cat(xs).cpu() if xs else torch.empty(0, dtype=dtype)
    return ScoredRows(sampled_logp=sampled, ids=cat(ids_out, torch.long), logp=cat(logp_out, torch.float32),
                      row_len=cat(len_out, torch.long), tail_mass=cat(tail_out, torch.float32))


def nucleus_rows(lse, cand_vals, cand_ids, rest, p, max_support):
    """(ids ascending, logp, row_len, tail) of each row's capped nucleus, from its top-max_support candidates
    (descending, as topk leaves them); the candidates past the nucleus join the tail."""
    logp_desc = cand_vals - lse.unsqueeze(1)
    size = capped_nucleus_size(logp_desc, p, max_support)
    beyond = torch.arange(cand_vals.shape[1], device=cand_vals.device).unsqueeze(0) >= size.unsqueeze(1)
    tail = (torch.logaddexp(rest, torch.logsumexp(cand_vals.masked_fill(~beyond, NEG_INF), dim=1)) - lse).exp()
    # ids ascending within each row: sort the kept ids, pushing the dropped ones (vocab and above) to the end
    keyed = cand_ids.masked_fill(beyond, torch.iinfo(cand_ids.dtype).max)
    order = keyed.argsort(dim=1)
    kept = ~beyond.gather(1, order)
    return cand_ids.gather(1, order)[kept], logp_desc.gather(1, order)[kept], size.long(), tail
