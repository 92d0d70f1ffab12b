"""The optimiser an Adapter steps, made so that a step can be left out on the device:
its state made before the first step (so that a left-out step puts back what was there),
and a step that changes nothing where a device flag says so, nor keeps values that are
not finite (adapter.py's module docstring says why it never waits for the device)."""

from __future__ import annotations

import torch

from cafa_cli.core.errors import UsageError


def new_optimizer(
    params: list[torch.nn.Parameter], kind: str, lr: float, momentum: float, fused: bool
) -> torch.optim.Optimizer | None:
    """`kind` (adam, sgd, nesterov, adamw) over `params`, its state made (start_state); None without params."""
    if not params:
        return None
    options = {"fused": True} if fused else {}
    if kind in ("sgd", "nesterov"):
        optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=kind == "nesterov", **options)
    elif kind == "adamw":  # torch's default weight decay, 0.01, as TPT's authors take it
        optimizer = torch.optim.AdamW(params, lr=lr, **options)
    else:
        optimizer = torch.optim.Adam(params, lr=lr, **options)
    with torch.inference_mode(False):  # reset() may be called under inference_mode; the steps change this state
        start_state(optimizer, fused=fused)
    return optimizer


def guarded_step(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> torch.Tensor:
    """The optimiser's step, which changes nothing where `skip` (float [1]) is 1; returns
    float [1], 1 where the values it wrote were not all finite, which it then put back
    (torch's fused CUDA kernels take the flag before the step: they check only that)."""
    if optimizer.defaults.get("fused"):
        # torch refuses a capture of a step not marked capturable, and warns about an eager
        # step that is (a fused step computes the same either way)
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        for group in optimizer.param_groups:
            group["capturable"] = capturing
        optimizer.found_inf = skip.reshape(())  # torch.amp's protocol (GradScaler.step sets it so too)
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
        return torch.zeros_like(skip)
    # what the step may change: the parameters and the state there is (start_state made it)
    changed = [p for group in optimizer.param_groups for p in group["params"]]
    changed += [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    saved = [t.clone() for t in changed]
    optimizer.step()
    written = torch.zeros_like(skip)
    torch._amp_foreach_non_finite_check_and_unscale_(
        [p for p in changed if p.is_floating_point()], written, torch.ones_like(written)
    )
    keep = torch.maximum(skip, written).bool().reshape(())
    for now, before in zip(changed, saved):
        torch.where(keep, before, now, out=now)
    return written


def check_weights_precision(params: list[torch.nn.Parameter], optimizer: str) -> None:
    """Adam on float16 weights writes NaN: its ε (1e-8) is 0 in float16, and its second
    moment underflows, so an update divides by zero. Refused (bf16 has float32's range)."""
    if optimizer in ("adam", "adamw") and any(p.dtype == torch.float16 for p in params):
        raise UsageError(
            "the weights to adapt are float16, and Adam's update underflows there and writes NaN; keep the model in "
            "float32 and give `precision` fp16 (autocast: fp16 speed, float32 weights), or use `optimizer` sgd"
        )


def start_state(optimizer: torch.optim.Optimizer, fused: bool) -> None:
    """The optimiser's state as its first step would create it, made now, so that a step
    left out can put back what was there before (it made nothing). Adam: step 0 and zero
    moments (fused Adam keeps its count on the device and makes its own). SGD's momentum
    buffer: -0.0, the additive identity, so its first update, buffer·momentum + gradient,
    is the gradient bit for bit, as torch's copy of it is; torch's fused SGD would leave a
    left-out first step's buffer uninitialised."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if isinstance(optimizer, torch.optim.SGD):
                if group["momentum"] != 0:
                    state["momentum_buffer"] = torch.full_like(p, -0.0, memory_format=torch.preserve_format)
            elif not fused:
                scalar = (
                    torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
                )  # as torch's Adam
                state["step"] = torch.tensor(0.0, dtype=scalar)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def restart_state(optimizer: torch.optim.Optimizer | None) -> None:
    """The state back to start_state's values, in place (a replayed step reads these same
    tensors): as a new optimiser's, no step and no moments."""
    if optimizer is None:
        return
    for slots in optimizer.state.values():
        for key, tensor in slots.items():
            if isinstance(tensor, torch.Tensor):
                tensor.fill_(-0.0 if key == "momentum_buffer" else 0.0)
