"""What the Adapter gives for deployment (Adapter.export, export_onnx, state_dict,
load_state_dict): the adapted network for serving, as torch modules or an ONNX file, and the
whole adaptation state as plain data."""

from __future__ import annotations

import contextlib
import copy
import io
import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from cafa_cli.core.errors import CafaError, InputError, UsageError, out_of_memory
from cafa_cli.core.files import atomic_write
from cafa_cli.data.preprocessing import Preprocessing
from cafa_cli.engine.method import Method
from cafa_cli.engine.norms import replace_submodule
from cafa_cli.engine.state import check_tensors, kind_of, load_module, refused, restore, snapshot, tensors_sha256
from cafa_cli.engine.threads import OneThreadAtATime
from cafa_cli.model.file_kinds import ADAPTER_STATE_FAMILY

# Adapter.state_dict()'s, checked by load_state_dict; 2 records what made the adaptation
# (weights, statistics, options) and leaves the options out of the method's state
STATE_FORMAT = f"{ADAPTER_STATE_FAMILY}2"
OWNED = "_cafa_adapter_owned"  # set on a net by the Adapter that adapts it


class Deployable(OneThreadAtATime):
    """What the Adapter (its subclass) gives for deployment, each one call at a time."""

    def export(self) -> torch.nn.Module:
        """The adapted network for serving, a plain copy: each normalisation layer the Adapter
        swapped in becomes a torch BatchNorm in eval mode holding the adapted affines and the
        statistics the stream arrived at (`norm` batch or prior: a running estimate of the test
        batches' statistics, BatchNorm's own momentum 0.1; alpha: that estimate mixed with the
        source's; ema and class-balanced: their running statistics; unmix: its components'
        mixture; source: the source's), so that it predicts one image as it predicts a batch.
        A teacher-student method's teacher is what serves (Method.served_network). Methods whose
        predictions are not their network's (t3a's prototypes, lame's batch assignment) have
        nothing to export."""
        with self._one_thread():
            return export(self)

    def export_onnx(
        self,
        path: str | Path,
        example: torch.Tensor | None = None,
        *,
        preprocessing: Preprocessing | None = None,
        class_names: Sequence[str] | None = None,
        metadata: dict[str, str] | None = None,
    ) -> None:
        """export()'s network written to `path` as ONNX (atomically), through torch's exporter
        (torch.export, `dynamo=True`): one input `images` [batch, channels, height, width], the
        model's input (the pixels already normalised), and one output `logits` [batch, classes];
        the batch size is free, the image size that of `example` (a batch of the network's
        input), else the `crop` of `preprocessing`. The graph computes what export()'s network
        computes: its BatchNorms normalise with the statistics the stream arrived at, never the
        batch's. The model's metadata (metadata_props) holds `preprocessing` (JSON: resize,
        crop, interpolation, channels, and mean and std one value a channel) and `class_names`
        (JSON), when given, for a serving stack to prepare images as cafa did, and `metadata`'s
        entries. Needs the `onnx` extra (onnx, onnxscript)."""
        with self._one_thread():
            network = export(self)
            check_onnx_writer("Adapter.export_onnx", network)
            metadata = {**serving_metadata(preprocessing, class_names), **(metadata or {})}
            write_onnx(network, path, example_input(network, example, preprocessing), metadata)

    def state_dict(self) -> dict:
        """Everything the adaptation has arrived at, as tensors and plain data that
        torch.save writes and torch.load(weights_only=True) reads: the weights, the
        optimiser's state, the running statistics, the method's own state (its moving means,
        banks, teachers: Method.state_dict) and torch's random number generator (CoTTA's and
        RoTTA's augmentations draw from it). load_state_dict() of a new Adapter made the same
        way (model, method, settings) goes on from there bit for bit."""
        with self._one_thread():
            return state_of(self)

    def load_state_dict(self, state: dict) -> None:
        """A state_dict() put back, of an Adapter of the same method and settings: the stream
        goes on from where that one was. torch's random number generator is set to where it was."""
        with self._one_thread():
            load_state(self, state)


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


def export(adapter: Deployable) -> torch.nn.Module:
    """Adapter.export(): the served network, its normalisation layers frozen (see there)."""
    check_exportable(adapter.method)
    net = copy.deepcopy(adapter.method.served_network(adapter).model)
    for name, module in list(net.named_modules()):
        if callable(getattr(module, "frozen", None)):
            replace_submodule(net, name, module.frozen())
    if hasattr(net, OWNED):
        delattr(net, OWNED)
    return net.eval().requires_grad_(False)


ONNX_EXTRA = "pip install 'cafa-cli[onnx]'"
ONNX_MAX_BYTES = 2 << 30  # protobuf's limit on one message: an ONNX file holding its weights


def check_onnx_writer(what: str, network: torch.nn.Module | None = None) -> None:
    """A UsageError unless torch's ONNX exporter can write `network` as one file: its packages
    (the `onnx` extra) are installed, and its weights are under protobuf's 2 GiB. Checked before
    a stream, so that `cafa adapt --export net.onnx` refuses before any work."""
    for package in ("onnx", "onnxscript"):
        try:
            __import__(package)
        except ImportError:
            raise UsageError(f"{what} needs onnx and onnxscript ({package} is not installed): {ONNX_EXTRA}") from None
    if network is not None:
        size = sum(t.numel() * t.element_size() for t in (*network.parameters(), *network.buffers()))
        if size >= ONNX_MAX_BYTES:
            raise UsageError(
                f"{what}: the network's {size / 2**30:.1f} GiB of weights do not fit one ONNX file (2 GiB at "
                f"most); export it as .safetensors"
            )


def serving_metadata(preprocessing: Preprocessing | None, class_names: Sequence[str] | None) -> dict[str, str]:
    """What a serving stack needs beside the graph to predict as cafa did, as ONNX metadata:
    how the images were prepared (mean and std one value a channel, whatever was given) and the
    names of the outputs."""
    metadata = {}
    if preprocessing is not None:
        mean, std = preprocessing.per_channel()
        metadata["preprocessing"] = json.dumps({**asdict(preprocessing), "mean": mean, "std": std})
    if class_names is not None:
        metadata["class_names"] = json.dumps(list(class_names))
    return metadata


def example_input(
    network: torch.nn.Module, example: torch.Tensor | None, preprocessing: Preprocessing | None
) -> torch.Tensor:
    """A batch of two of the network's input, on the CPU, of the image size the ONNX graph takes:
    `example`'s, else the preprocessing's crop. Two: torch.export may specialise a dimension of
    size 1 to a constant, and the batch size must stay free."""
    if example is None:
        if preprocessing is None or preprocessing.crop is None:
            raise UsageError(
                "the ONNX graph takes images of one size: give an `example` batch of the network's input, or a "
                "`preprocessing` with a `crop`"
            )
        example = torch.zeros(1, preprocessing.channels, preprocessing.crop, preprocessing.crop)
    if not isinstance(example, torch.Tensor) or example.dim() < 2 or example.shape[0] == 0:
        raise UsageError(f"`example` must be a batch of the network's input, not {kind_of(example)}")
    dtype = next((p.dtype for p in network.parameters()), torch.float32)
    return example[:1].to("cpu", dtype).repeat(2, *[1] * (example.dim() - 1))


def write_onnx(network: torch.nn.Module, path: str | Path, example: torch.Tensor, metadata: dict[str, str]) -> None:
    """`network` traced on `example` by torch's exporter and written to `path` as one ONNX file,
    atomically, the batch size free (export_onnx)."""
    network = network.cpu()  # the graph is the same on any device; the trace need not hold GPU memory
    said = io.StringIO()  # torch's exporter prints each try and failure: not among the records on stdout
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            program = torch.onnx.export(
                network,
                (example,),
                dynamo=True,
                dynamic_shapes=({0: torch.export.Dim("batch")},),
                input_names=["images"],
                output_names=["logits"],
                verbose=False,
            )
    except Exception as error:  # an operation or a control flow torch.export cannot trace
        if out_of_memory(error):
            raise
        while error.__cause__ is not None:  # the exporter's own error wraps torch.export's, which says why
            error = error.__cause__
        first = (str(error).strip().splitlines() or [""])[0]
        raise CafaError(
            f"cannot write {path}: torch's ONNX exporter cannot trace this network ({type(error).__name__}: "
            f"{first}); export it as .safetensors"
        ) from None
    program.model.metadata_props.update(metadata)
    atomic_write(path, lambda tmp: program.save(tmp, external_data=False))


def state_of(adapter: Deployable) -> dict:
    """Adapter.state_dict(): the adaptation as plain data (see there)."""
    return {
        "format": STATE_FORMAT,
        "adaptation": adaptation(adapter),
        "model": snapshot(adapter.model.state_dict()),
        "optimizer": None if adapter.optimizer is None else snapshot(adapter.optimizer.state_dict()),
        "scaler": None if adapter.scaler is None else snapshot(adapter.scaler.state_dict()),
        "skipped": adapter._skipped.clone(),
        "balanced": None if adapter.balanced is None else snapshot(adapter.balanced.saved()),
        "method_state": adapter.method.state_dict(),
        "rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state(adapter.device) if adapter.device.type == "cuda" else None,
    }


def adaptation(adapter: Deployable) -> dict:
    """Everything that shapes what the adaptation does and that a state does not carry: the
    method, the Adapter's settings, the method's options, and the sha256 of the data both were
    made from (the source weights, the class statistics and moments, EATA's Fisher): a state
    goes on only where all of these are the same (load_state)."""
    method = adapter.method
    if adapter._made_from is None:  # computed once: the source weights and inputs never change
        adapter._made_from = {
            "weights": tensors_sha256(adapter.source_state),
            "class_moments": adapter._class_moments_sha256,
            **method.fingerprints(),
        }
    return {
        "method": method.name or type(method).__name__,
        **adapter.settings.record(),  # what a saved state must have been made with
        **{f"option {option.name}": getattr(method, option.name) for option in type(method).options},
        **{f"{name} sha256": value for name, value in adapter._made_from.items()},
    }


def load_state(adapter: Deployable, state) -> None:
    """Adapter.load_state_dict(): a state_of() put back (see there). The state is untrusted
    input: it is checked against what this Adapter built, entry by entry, and poured into it
    (engine/state.py); whatever does not fit is an InputError, and the Adapter is then put
    back as it was before the call."""
    check_format(state)
    ours = adaptation(adapter)
    # an option the method gained after the state was saved is absent from it: the state was
    # made as that option's default makes it
    defaults = {f"option {option.name}": option.default for option in type(adapter.method).options}
    differ = [
        f"{key} {shown(state['adaptation'].get(key, defaults.get(key)))} (here {shown(value)})"
        for key, value in ours.items()
        if state["adaptation"].get(key, defaults.get(key)) != value
    ]
    differ += [f"{key} {shown(value)} (not here)" for key, value in state["adaptation"].items() if key not in ours]
    if differ:
        raise UsageError(
            f"the saved state is of another adaptation: {', '.join(differ)}; adapt with its settings, weights and "
            f"statistics"
        )
    before = state_of(adapter)
    try:
        pour(adapter, state)
    except Exception as error:
        pour(adapter, before)  # what it was: a state it made itself always fits
        if isinstance(error, InputError):
            raise
        raise refused("contents", f"do not fit this adaptation ({type(error).__name__}: {error})") from None
    if adapter.graph is not None:  # its optimiser state and the method's may be new tensors
        adapter.graph.drop()


def check_format(state) -> None:
    """The top level of a state: the format, and each entry of the kind it must be."""
    if not isinstance(state, dict) or not str(state.get("format", "")).startswith(ADAPTER_STATE_FAMILY):
        raise InputError("not a saved Adapter state (Adapter.state_dict(), cafa adapt --state)")
    if state["format"] != STATE_FORMAT:
        raise InputError(
            f"a state saved by another version of cafa ({state['format']}, here {STATE_FORMAT}), which cannot be "
            f"checked against this adaptation"
        )
    kinds = {
        "format": str, "adaptation": dict, "model": dict, "optimizer": (dict, type(None)), "scaler": (dict, type(None)),
        "skipped": torch.Tensor, "balanced": object, "method_state": dict, "rng": torch.Tensor,
        "cuda_rng": (torch.Tensor, type(None)),
    }  # fmt: skip
    missing, extra = [k for k in kinds if k not in state], [k for k in state if k not in kinds]
    if missing or extra:
        raise refused("entries", f"lack {', '.join(missing)}" if missing else f"include {', '.join(map(str, extra))}")
    for key, kind in kinds.items():
        if not isinstance(state[key], kind):
            raise refused(key, f"is {kind_of(state[key])}")


def pour(adapter: Deployable, state: dict) -> None:
    """Each entry of a checked state into the Adapter's own objects (load_state)."""
    load_module(adapter.model, state["model"], "model")
    if (state["optimizer"] is None) != (adapter.optimizer is None):
        raise refused("optimizer", "is of a method that trains" if adapter.optimizer is None else "is missing")
    if adapter.optimizer is not None:
        check_optimizer(adapter.optimizer, state["optimizer"])
        adapter.optimizer.load_state_dict(state["optimizer"])
    if (state["scaler"] is None) != (adapter.scaler is None):
        raise refused("scaler", "is of another precision")
    if adapter.scaler is not None:
        adapter.scaler.load_state_dict(restore(adapter.scaler.state_dict(), state["scaler"], "scaler"))
    restore(adapter._skipped, state["skipped"], "skipped")
    if (state["balanced"] is None) != (adapter.balanced is None):
        raise refused("balanced", "is of another `norm`")
    if adapter.balanced is not None:
        adapter.balanced.restore(restore(adapter.balanced.saved(), state["balanced"], "balanced"))
    adapter.method.load_state_dict(state["method_state"])
    for key, ours in (("rng", torch.get_rng_state()), ("cuda_rng", None)):
        theirs = state[key]
        if theirs is not None and (theirs.dtype != torch.uint8 or ours is not None and theirs.shape != ours.shape):
            raise refused(key, f"is {kind_of(theirs)}, not a random number generator's state")
    torch.set_rng_state(state["rng"])
    if state["cuda_rng"] is not None and adapter.device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda_rng"], adapter.device)


def check_optimizer(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """An optimiser's state dict of the same parameters and settings as `optimizer`'s, each
    parameter's state tensors shaped as it is or scalars: torch's load_state_dict checks little."""
    own = optimizer.state_dict()
    if set(saved) != {"state", "param_groups"} or not isinstance(saved["param_groups"], list):
        raise refused("optimizer", "is not an optimiser's state")
    if len(saved["param_groups"]) != len(own["param_groups"]):
        raise refused("optimizer", f"has {len(saved['param_groups'])} parameter groups, not {len(own['param_groups'])}")
    for i, (ours, theirs) in enumerate(zip(own["param_groups"], saved["param_groups"])):
        if not isinstance(theirs, dict) or set(theirs) - {"capturable"} != set(ours) - {"capturable"}:
            raise refused(f"optimizer group {i}", "has other settings (another optimiser?)")
        changed = [key for key in ours if key != "capturable" and theirs[key] != ours[key]]
        if changed:
            raise refused(f"optimizer group {i}", f"has another {', '.join(changed)}")
    params = dict(
        zip(
            (i for group in own["param_groups"] for i in group["params"]),
            (p for group in optimizer.param_groups for p in group["params"]),
        )
    )
    if not isinstance(saved["state"], dict) or not set(saved["state"]) <= set(params):
        raise refused("optimizer", "holds the state of other parameters")
    for index, entry in saved["state"].items():
        where = f"optimizer state {index}"
        if index in own["state"]:
            check_tensors(own["state"][index], entry, where)
            continue
        if not isinstance(entry, dict) or not all(  # fused Adam makes its state at its first step
            isinstance(t, torch.Tensor) and t.is_floating_point() and t.shape in ((), params[index].shape)
            for t in entry.values()
        ):
            raise refused(where, "is not a state of its parameter")


def shown(value) -> str:
    """A setting as a difference names it: a sha256 by its first 12 digits."""
    return f"{value[:12]}…" if isinstance(value, str) and len(value) == 64 else str(value)
