"""Forward passes shared by the engine, the trainer, the consistency checker and the teachers.

One function computes a token's logprob from a model, so that engine and trainer agree by construction
wherever they can (the consistency checker measures where they cannot).
"""
from __future__ import annotations

import torch


def position_ids_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions count real tokens only, so left and right padding give the same positions."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T)[target], computed in fp32. logits [..., V], targets [...]."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def forward_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_for(attention_mask))
    return out.logits


def sequence_logprobs(model, input_ids, attention_mask, temperature: float = 1.0) -> torch.Tensor:
    """[B, T] logprob of token t given tokens < t (0 at t=0 and on padding)."""
    logits = forward_logits(model, input_ids, attention_mask)
    out = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    out[:, 1:] = token_logprobs(logits[:, :-1], input_ids[:, 1:], temperature)
    return out * attention_mask


def nucleus_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Logprobs of the distribution actually sampled from: softmax(logits/T) renormalised on the top-p nucleus.

    logits [N, V]; temperature, top_p [N]. Tokens outside the nucleus get -inf.
    """
    logp = torch.log_softmax(logits.float() / temperature.unsqueeze(-1), dim=-1)
    if bool((top_p >= 1.0).all()):
        return logp
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    mass_before = sorted_logp.exp().cumsum(-1) - sorted_logp.exp()
    drop_sorted = mass_before >= top_p.unsqueeze(-1)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    logp = logp.masked_fill(drop, float("-inf"))
    return logp - torch.logsumexp(logp, dim=-1, keepdim=True)


def sample_tokens(logits, temperature, top_p, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (ids [N], logprob of each id under the sampled distribution [N])."""
    logp = nucleus_logprobs(logits, temperature, top_p)
    ids = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
    return ids, logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def sft_loss(model, input_ids, attention_mask, loss_mask) -> torch.Tensor:
    """Token-mean cross-entropy on positions where loss_mask is 1 (the answer, not the prompt)."""
    logp = sequence_logprobs(model, input_ids, attention_mask)
    return -(logp * loss_mask).sum() / loss_mask.sum().clamp(min=1)
