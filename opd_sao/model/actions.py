"""What the teachers and the consistency gate read off a model at the action tokens: the final hidden state before
each one (the lm head then scores it: `modeling.token_logprobs`, `teachers/scoring.py`)."""
from __future__ import annotations

import torch

from opd_sao.trajectory import Trajectory

from .modeling import hidden_states, marked


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
