"""What the Adapter gives for deployment (Adapter.export, state_dict, load_state_dict):
the adapted network for serving, and the whole adaptation state as plain data."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch

from cafa_cli.errors import InputError, UsageError
from cafa_cli.method.methods.base import Method
from cafa_cli.method.norms import replace_submodule
from cafa_cli.method.state import restore, snapshot

if TYPE_CHECKING:
    from cafa_cli.method.adapter import Adapter

STATE_FORMAT = "cafa-adapter-state-1"  # Adapter.state_dict()'s, checked by load_state_dict
OWNED = "_cafa_adapter_owned"  # set on a net by the Adapter that adapts it


def check_exportable(method: Method) -> None:
    """A UsageError for a method whose predictions are not its network's (t3a, lame; memo, ttaug:
    Method.not_served): known before a stream, so that `cafa adapt --export` refuses before any work."""
    why = "it changes the logits a batch at a time" if type(method).output is not Method.output else method.not_served
    if why:
        name = method.name or type(method).__name__
        raise UsageError(
            f"{name} predicts with more than its network ({why}): an "
            f"exported network would predict otherwise; serve through the Adapter's step"
        )


def export(adapter: Adapter) -> torch.nn.Module:
    """Adapter.export(): the served network, its normalisation layers frozen (see there)."""
    check_exportable(adapter.method)
    net = copy.deepcopy(adapter.method.served_network(adapter).model)
    for name, module in list(net.named_modules()):
        if callable(getattr(module, "frozen", None)):
            replace_submodule(net, name, module.frozen())
    if hasattr(net, OWNED):
        delattr(net, OWNED)
    return net.eval().requires_grad_(False)


def state_of(adapter: Adapter) -> dict:
    """Adapter.state_dict(): the adaptation as plain data (see there)."""
    return {
        "format": STATE_FORMAT,
        "method": adapter.method.name or type(adapter.method).__name__,
        "settings": dict(adapter._settings),
        "model": snapshot(adapter.model.state_dict()),
        "optimizer": None if adapter.optimizer is None else snapshot(adapter.optimizer.state_dict()),
        "scaler": None if adapter.scaler is None else snapshot(adapter.scaler.state_dict()),
        "skipped": adapter._skipped.clone(),
        "norms": [snapshot(layer.before) for layer in adapter.norms],
        "balanced": None if adapter.balanced is None else snapshot(adapter.balanced.saved()),
        "method_state": adapter.method.state_dict(),
        "rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state(adapter.device) if adapter.device.type == "cuda" else None,
    }


def load_state(adapter: Adapter, state: dict) -> None:
    """Adapter.load_state_dict(): a state_of() put back (see there)."""
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise InputError("not a saved Adapter state (Adapter.state_dict(), cafa adapt --state)")
    method = adapter.method.name or type(adapter.method).__name__
    if state["method"] != method or state["settings"] != adapter._settings:
        theirs = {"method": state["method"], **state["settings"]}
        ours = {"method": method, **adapter._settings}
        differ = [f"{key} {theirs.get(key)} (here {ours.get(key)})" for key in ours if theirs.get(key) != ours[key]]
        raise UsageError(f"the saved state is of another adaptation: {', '.join(differ)}; adapt with its settings")
    adapter.model.load_state_dict(state["model"])
    if adapter.optimizer is not None:
        adapter.optimizer.load_state_dict(state["optimizer"])
    if adapter.scaler is not None:
        adapter.scaler.load_state_dict(state["scaler"])
    adapter._skipped.copy_(state["skipped"])
    for layer, before in zip(adapter.norms, state["norms"]):
        layer.before = restore(layer.before, before)
    if adapter.balanced is not None:
        adapter.balanced.restore(restore(adapter.balanced.saved(), state["balanced"]))
    adapter.method.load_state_dict(state["method_state"])
    torch.set_rng_state(state["rng"])
    if state["cuda_rng"] is not None and adapter.device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda_rng"], adapter.device)
    if adapter.graph is not None:  # its optimiser state and the method's may be new tensors
        adapter.graph.drop()
