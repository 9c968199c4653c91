"""One check shared by the tests of exact shortcuts (a shared prompt, a cut last block): the same gradients."""
from __future__ import annotations

import torch


def assert_same_gradients(got: torch.Tensor, want: torch.Tensor, got_model, want_model, generator: torch.Generator,
                          tol: float) -> None:
    """Back-propagate one random upstream gradient through `got` and `want` (outputs of two copies of a model) and
    compare every parameter's gradient, relative to the largest of it (a frozen parameter has none on either side)."""
    upstream = torch.randn(got.shape, generator=generator)
    (got * upstream).sum().backward()
    (want * upstream).sum().backward()
    for (name, p), q in zip(got_model.named_parameters(), want_model.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            assert (p.grad - q.grad).abs().max() <= tol * max(1.0, float(q.grad.abs().max())), name
