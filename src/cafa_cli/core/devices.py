"""Which device runs the model, and the errors that are the device's, not the input's."""

from __future__ import annotations

import torch

from cafa_cli.core.errors import UsageError

GPU_OUT_OF_MEMORY = torch.cuda.OutOfMemoryError  # a RuntimeError, not a MemoryError


# torch.AcceleratorError (a CUDA error) is new in torch 2.8
DEVICE_FAILURES = (GPU_OUT_OF_MEMORY, *((torch.AcceleratorError,) if hasattr(torch, "AcceleratorError") else ()))


def pick_device(device: str | torch.device) -> torch.device:
    """`auto` → cuda when present; `cuda[:N]` without CUDA is a usage error, not a crash."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(device)
    except RuntimeError:
        raise UsageError(f"`device` {device}: expected auto, cpu, cuda or cuda:N") from None
    if chosen.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"`device` {device}: CUDA is not available on this machine; use `device` cpu or auto")
        if chosen.index is not None and chosen.index >= torch.cuda.device_count():
            raise UsageError(f"`device` {device}: only {torch.cuda.device_count()} CUDA device(s) here")
    elif chosen.type != "cpu":
        raise UsageError(f"`device` {device}: expected auto, cpu, cuda or cuda:N")
    return chosen
