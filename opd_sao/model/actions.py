"""What a caller reads off a model at the action tokens, one call each: the trainer backends' OPD support logprobs and
full-vocabulary divergence, the critic's values (its value head), and the final hidden state before each action
(teacher scoring and the consistency gate, whose lm head then scores it: `modeling.token_logprobs`,
`teachers/scoring.py`). The policy's logprobs are `modeling.sequence_logprobs`. Each picks opd-sao's own forward or
transformers' inside (`modeling.hidden_states`, `llama_forward.serves`), so a trainer step enters the model adapter
once per forward."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

import opd_sao.model.llama_forward as llama_forward  # the module, not the package: no edge to __init__
from opd_sao.trajectory import Trajectory

from .modeling import (
    dense_support_logprobs,
    forward_logits,
    hidden_states,
    lm_head,
    logit_chunks,
    marked,
    position_ids_for,
    read_only_at,
    streamed_divergence,
    support_logprobs,
    vocab_rows,
)

SupportLogprobs = tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]


def model_device(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def action_hidden_states(model, trajectories: list[Trajectory], *, padding: str = "right",
                         batch_size: int = 8) -> torch.Tensor:
    """[N, H] the final hidden state that predicts each action token (rows: trajectory order, then position;
    as in `consistency.check.ActionTokens.of`).

    Sequences go through the decoder batch_size at a time, padded on `padding`'s side with the attention
    mask and real-token position ids (the diagnosis compares the two sides: a correct model gives the
    same numbers either way).
    """
    device = model_device(model)
    out = []
    for first in range(0, len(trajectories), batch_size):
        chunk = trajectories[first:first + batch_size]
        seqs = [t.prompt_ids + t.token_ids for t in chunk]
        width = max(len(s) for s in seqs)
        offsets = [width - len(seq) if padding == "left" else 0 for seq in seqs]
        input_ids = torch.tensor([[0] * o + s + [0] * (width - o - len(s)) for o, s in zip(offsets, seqs)])
        attention = torch.tensor([[0] * o + [1] * len(s) + [0] * (width - o - len(s)) for o, s in zip(offsets, seqs)])
        rows, columns = [], []  # the position before each action token, trajectory by trajectory
        for i, traj in enumerate(chunk):
            before = offsets[i] + len(traj.prompt_ids) - 1
            picked = [before + j for j, acted in enumerate(traj.action_mask) if acted]
            rows += [i] * len(picked)
            columns += picked
        rows_t, columns_t = (torch.tensor(x, dtype=torch.long, device=device) for x in (rows, columns))
        input_ids = input_ids.to(device)
        hidden = hidden_states(model, input_ids, attention.to(device), read=marked(input_ids, rows_t, columns_t))
        out.append(hidden[rows_t, columns_t])
    return torch.cat(out) if out else torch.empty(0, model.config.hidden_size, device=device)


def action_support_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, action_mask: torch.Tensor,
                            support_ids: Optional[torch.Tensor], support_mask: Optional[torch.Tensor], *,
                            vocab_chunk: int, top_k: int, full_logits: bool = False,
                            vocab_size: Optional[int] = None) -> SupportLogprobs:
    """`TrainerBackend.policy_support_logprobs` on a model and the tensors of a batch (both backends' one path).

    The final hidden state before every action token goes through the lm head one vocabulary chunk at a
    time (`support_logprobs`); the whole vocabulary (`support_ids` None) is the [N, V] log-softmax.
    `full_logits=True` runs the model's own forward instead (ZeRO-3, whose lm head weight is only gathered
    inside it) and reads the action rows of its logits (`dense_support_logprobs`)."""
    b, t = action_mask.bool().nonzero(as_tuple=True)
    if full_logits:
        logits = forward_logits(model, input_ids, attention_mask)[b, t - 1, :vocab_size].float()
        if support_ids is not None:
            return dense_support_logprobs(logits, support_ids, support_mask, top_k=top_k)
    else:
        hidden = hidden_states(model, input_ids, attention_mask, read=marked(input_ids, b, t - 1))[b, t - 1]
        weight, bias = vocab_rows(*lm_head(model), vocab_size)
        if support_ids is not None:
            return support_logprobs(hidden, weight, bias, support_ids, support_mask, vocab_chunk=vocab_chunk,
                                    top_k=top_k)
        logits = torch.cat([chunk for _, chunk in logit_chunks(hidden, weight, bias, vocab_chunk)], -1)
    logp = torch.log_softmax(logits, -1)
    tail = torch.full((len(logp),), math.log(torch.finfo(torch.float32).tiny), device=logp.device)
    top = logp.detach().topk(min(top_k, logp.shape[1]), dim=-1).indices if top_k else None
    return logp, tail, top


def action_full_divergence(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, action_mask: torch.Tensor,
                           teacher, terms, *, report=None, vocab_chunk: int, top_k: int,
                           vocab_size: Optional[int] = None) -> tuple[torch.Tensor, ...]:
    """`TrainerBackend.policy_full_divergence` on a model and the tensors of a batch, streamed over the vocabulary
    (`modeling.streamed_divergence`): (divergence [N], report [N], top-k ids [N, k] when top_k)."""
    b, t = action_mask.bool().nonzero(as_tuple=True)
    hidden = hidden_states(model, input_ids, attention_mask, read=marked(input_ids, b, t - 1))[b, t - 1]
    weight, bias = vocab_rows(*lm_head(model), vocab_size)
    div, extra, top = streamed_divergence(hidden, weight, bias, teacher, terms, report=report,
                                          vocab_chunk=vocab_chunk, top_k=top_k)
    return (div, extra) if top is None else (div, extra, top)


def action_values(backbone: torch.nn.Module, value_head: torch.nn.Module, input_ids: torch.Tensor,
                  attention_mask: torch.Tensor, actions: Optional[torch.Tensor] = None,
                  starts: Optional[llama_forward.FrozenStarts] = None) -> torch.Tensor:
    """[B, T] V(s_t), the value of the state before token t, on real tokens (`trainers.critic.ValueModel`: a
    decoder `backbone` and a scalar `value_head`); `actions` [B, T]: only at these tokens (0 elsewhere: GAE and the
    value loss read no other), the last layer's feed-forward block skipping the states no action follows
    (`read_only_at`; `llama_forward` reads them alone). `starts`: the frozen starts kept over a step's critic
    forwards (`ValueModel.reusing_frozen_start`)."""
    keep = attention_mask if actions is None else attention_mask * actions.to(attention_mask.dtype)
    read = None if actions is None else F.pad(keep[:, 1:], (0, 1))  # V(s_t) is read off token t - 1
    positions = position_ids_for(attention_mask)
    if read is not None and llama_forward.serves(backbone):
        start = None if starts is None else starts.start_for(backbone, input_ids, attention_mask, read,
                                                             value_head.weight.element_size())
        hidden = llama_forward.hidden_states_at(backbone, input_ids, attention_mask, positions, read, start=start)
    else:
        with read_only_at(backbone, read):
            hidden = backbone(input_ids=input_ids, attention_mask=attention_mask,
                              position_ids=positions).last_hidden_state
    # the head's dtype (float32 master weights, DeepSpeed's bf16, float64); values at least float32
    state_values = value_head(hidden.to(value_head.weight.dtype)).squeeze(-1)  # after reading token t
    state_values = state_values.to(torch.promote_types(state_values.dtype, torch.float32))
    values = torch.zeros_like(state_values)
    values[:, 1:] = state_values[:, :-1]  # V(s_t): state before token t
    return values * keep
