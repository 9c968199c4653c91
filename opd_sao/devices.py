"""Where models and tensors live: the config's `device` strings resolved to `torch.device`s.

One function decides, so the run, the engine, the trainer, the teachers and `serve` agree on what
`auto` means, and a CUDA request on a machine without CUDA is refused in one line before any work.
"""
from __future__ import annotations

import contextlib
import re
from typing import TYPE_CHECKING, ContextManager, Optional

from opd_sao.errors import UsageError

if TYPE_CHECKING:
    import torch

DEVICE_PATTERN = r"^(auto|cpu|cuda(:\d+)?)$"


def resolve_device(spec: Optional[str]) -> torch.device:
    """`auto` (or None): cuda if torch sees a GPU, else cpu; `cpu`; `cuda` / `cuda:N`, refused when absent."""
    spec = spec or "auto"
    if not re.match(DEVICE_PATTERN, spec):
        raise UsageError(f"device {spec!r} is not one of auto, cpu, cuda, cuda:N")
    import torch  # here, not at the top: the config's check of a `device` setting needs no torch until it runs

    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"no CUDA device on this machine (torch {torch.__version__}) for device {spec!r}; "
                             "use cpu or auto")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise UsageError(f"this machine has {count} CUDA device(s), so no device {spec!r}")
    return device


def check_device(spec: Optional[str]) -> None:
    """UsageError when `spec` is no device of this machine (as resolve_device); auto and cpu always are, known
    without importing torch (a config's or a command's check before any work)."""
    if (spec or "auto") not in ("auto", "cpu"):
        resolve_device(spec)


def mixed_precision(device: torch.device, dtype: str) -> ContextManager:
    """The trainers' compute precision: float32 master weights (AdamW's small updates are not rounded away,
    as they are on bfloat16 weights), with `dtype: bfloat16` the forward's matmuls in bfloat16 under
    `torch.autocast`; float32 (and float64, whose weights are float64 too): nothing to do."""
    if dtype != "bfloat16":
        return contextlib.nullcontext()
    import torch

    return torch.autocast(device.type, dtype=getattr(torch, dtype))
