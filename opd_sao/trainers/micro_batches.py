"""Micro-batches: a step's forward and backward passes in pieces, with the whole batch's update.

A grad=True forward split into several micro-batches runs without autograd, and its outputs are leaves the
Learner's loss reads as if they came from one pass. At the step, the loss's gradient with respect to those
outputs is back-propagated into the weights one micro-batch at a time (each re-run with a graph, then freed), so
the accumulated gradient is exactly the whole batch's: any normalisation the loss does (token means over the
whole step, GRPO's groups, OPD's supports) sees the whole batch, whatever the split. It costs one more forward
per micro-batch; the memory of a step is one micro-batch's activations. A forward that fits in one micro-batch
keeps its graph instead (no second forward).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F

Outputs = tuple[torch.Tensor, ...]


@dataclass
class Rows:
    """The part of a batch the trainer's forward passes need (what the DeepSpeed backend's rank 0 sends the
    others): right-padded [B, T] tensors."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    top_p: Optional[torch.Tensor] = None  # [B] each row's sampling nucleus (policy forwards)
    action_mask: Optional[torch.Tensor] = None  # [B, T] policy forwards score these tokens only; support forwards
    # give one output row per action token

    @classmethod
    def of(cls, batch, *, top_p: bool = False, actions: bool = False) -> "Rows":
        return cls(batch.input_ids.cpu(), batch.attention_mask.cpu(), batch.top_p if top_p else None,
                   batch.action_mask.cpu() if actions else None)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def lengths(self) -> torch.Tensor:
        return self.attention_mask.sum(-1)

    def action_rows(self) -> torch.Tensor:
        """[B + 1] where each row's action tokens start among all the action tokens (support outputs' rows)."""
        return torch.cat([torch.zeros(1, dtype=torch.long), self.action_mask.bool().sum(1).cumsum(0)])

    def take(self, rows: torch.Tensor, device: torch.device) -> "Rows":
        """These rows on `device`, cut at their longest sequence (the columns past it are padding)."""
        mask = self.attention_mask[rows]
        width = max(1, int(mask.sum(-1).max()))
        return Rows(self.input_ids[rows, :width].to(device), mask[:, :width].to(device),
                    None if self.top_p is None else self.top_p[rows],
                    None if self.action_mask is None else self.action_mask[rows, :width].to(device))


def widen(x: torch.Tensor, width: int) -> torch.Tensor:
    """[b, w] -> [b, width]: a cut micro-batch's per-position output back at the batch's width (zeros after)."""
    return F.pad(x, (0, width - x.shape[1]))


def micro_batches(lengths: torch.Tensor, size: Optional[int], max_tokens: Optional[int]) -> list[torch.Tensor]:
    """Row indices of each micro-batch (ascending within one), for rows of these real lengths.

    Rows go longest first, so each micro-batch holds similar lengths and its padding (every row is cut to its
    longest) is small; a micro-batch closes at `size` rows or when rows x its longest would pass `max_tokens` (a
    row longer than that goes alone). Neither limit: one micro-batch of every row."""
    n = len(lengths)
    if size is None and max_tokens is None:
        return [torch.arange(n)]
    order = sorted(range(n), key=lambda i: (-int(lengths[i]), i))
    plan: list[list[int]] = []
    for i in order:  # longest first: a micro-batch's first row is its longest
        current = plan[-1] if plan else []
        if not current or (size is not None and len(current) >= size) or (
                max_tokens is not None and (len(current) + 1) * int(lengths[current[0]]) > max_tokens):
            plan.append(current := [])
        current.append(i)
    return [torch.tensor(sorted(rows), dtype=torch.long) for rows in plan]


def assemble(parts: list[tuple[torch.Tensor, Outputs]], rows: int) -> Outputs:
    """The whole outputs from each micro-batch's (output rows, outputs)."""
    whole = []
    for j, first in enumerate(parts[0][1]):
        full = torch.zeros((rows, *first.shape[1:]), dtype=first.dtype, device=first.device)
        for where, out in parts:
            full[where.to(full.device)] = out[j]
        whole.append(full)
    return tuple(whole)


@dataclass
class Deferred:
    """A grad=True forward that ran in micro-batches without a graph: `forward(batch rows, output rows)` re-runs
    one with a graph; `out_rows[i]` are micro-batch i's rows of the outputs `leaves`."""

    forward: Callable[[torch.Tensor, torch.Tensor], Outputs]
    rows: list[torch.Tensor]
    out_rows: list[torch.Tensor]
    leaves: Outputs

    def surrogates(self, grads: list[Optional[torch.Tensor]]) -> Iterator[torch.Tensor]:
        """Per micro-batch, a scalar whose gradient in the weights is that micro-batch's share of the loss's:
        sum(output * dloss/doutput) (outputs without a gradient contribute nothing; a micro-batch with none still
        gets a backward, of zeros: under DeepSpeed every rank runs the same backwards)."""
        for rows, where in zip(self.rows, self.out_rows):
            with torch.enable_grad():
                outs = self.forward(rows, where)
            terms = [(out * grad[where.to(grad.device)].to(out.dtype)).sum()
                     for out, grad in zip(outs, grads) if grad is not None and out.requires_grad]
            yield sum(terms) if terms else sum(out.sum() * 0 for out in outs if out.requires_grad)


def micro_forward(forward: Callable[[torch.Tensor, torch.Tensor], Outputs], rows: list[torch.Tensor],
                  out_rows: list[torch.Tensor], total_rows: int, grad: bool,
                  keep_graph: Optional[bool] = None) -> tuple[Outputs, Optional[Deferred]]:
    """`forward(batch rows, output rows)` (outputs at the whole batch's widths) over the micro-batches, assembled.

    `keep_graph` (default: a single micro-batch, which then holds every output row in order): the outputs with
    their graph. Otherwise, with grad: leaves of no-graph outputs (integer ones, index outputs, stay plain), and
    the `Deferred` that back-propagates into them at the step."""
    if keep_graph is None:
        keep_graph = len(rows) == 1
    if keep_graph:
        with torch.set_grad_enabled(grad):
            return forward(rows[0], out_rows[0]), None
    with torch.no_grad():
        whole = assemble([(where, forward(r, where)) for r, where in zip(rows, out_rows)], total_rows)
    if not grad:
        return whole, None
    whole = tuple(x.requires_grad_() if x.is_floating_point() else x for x in whole)
    return whole, Deferred(forward, rows, out_rows, whole)
