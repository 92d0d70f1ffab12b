"""Resolve `--model` / `--weights` into a module, and split it into features + classifier.

The features CAFA aligns are the input of the final linear layer. A forward pre-hook
captures them, so any architecture works without rewriting its forward.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import pickle
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from cafa_cli.errors import InputError, UsageError, listing
from cafa_cli.files import absolute, open_safetensors

HTML_MARKERS = (b"<!doctype", b"<html", b"<?xml", b"<head")
# what a clone without git-lfs leaves in place of a large file: a few lines of text
LFS_POINTER = b"version https://git-lfs.github.com/spec/"
# torch.save writes a zip archive, or (legacy format) a pickle of protocol 2 or later
TORCH_SAVE_MARKERS = (b"PK", b"\x80")
PLAIN_PICKLE = (b"\x80\x04", b"\x80\x05")  # pickle protocol 4/5: pickle.dump's, never torch.save's
# a MemoryError reading a file this small comes from a garbage length field, not from the weights
SMALL_FILE = 1 << 20
GPU_OUT_OF_MEMORY = torch.cuda.OutOfMemoryError  # a RuntimeError, not a MemoryError
# torch.AcceleratorError (a CUDA error) is new in torch 2.8
DEVICE_FAILURES = (GPU_OUT_OF_MEMORY, *((torch.AcceleratorError,) if hasattr(torch, "AcceleratorError") else ()))


@dataclass(frozen=True)
class ModelSpec:
    """What the artifact records so that `adapt` can rebuild the exact model."""

    model: str
    weights: str | None = None  # absolute path
    weights_sha256: str | None = None
    num_classes: int | None = None
    classifier: str | None = None


def build_model(model: str, num_classes: int | None = None) -> nn.Module:
    """A torchvision architecture name, a bundled model name, or `file.py:fn` / `pkg.mod:fn`."""
    from cafa_cli.zoo import BUNDLED, load_bundled

    if model in BUNDLED:
        return load_bundled(model)
    if ":" in model:
        return _from_factory(model, num_classes)
    import torchvision

    names = torchvision.models.list_models(module=torchvision.models)
    if model not in names:
        hint = f" (did you mean {', '.join(close)}?)" if (close := _close_names(model, names)) else ""
        raise UsageError(
            f"--model {model}: unknown architecture{hint}; give a torchvision classification model, "
            f"one of {', '.join(sorted(BUNDLED))}, or a factory 'file.py:function'"
        )
    kwargs = {"num_classes": num_classes} if num_classes is not None else {}
    return torchvision.models.get_model(model, weights=None, **kwargs)


def _close_names(name: str, names: list[str]) -> list[str]:
    """Architectures a mistyped --model may mean: the names that contain it, or spell it
    nearly alike, ignoring case, `-` and `_` (resnet-50, ResNet50, resnt50 → resnet50)."""
    plain = {n.replace("_", ""): n for n in names}
    wanted = name.lower().replace("-", "").replace("_", "")
    containing = [n for key, n in plain.items() if wanted in key]
    return (containing or [plain[key] for key in difflib.get_close_matches(wanted, plain, n=5, cutoff=0.8)])[:5]


def _from_factory(spec: str, num_classes: int | None) -> nn.Module:
    location, _, function = spec.rpartition(":")
    if not function.isidentifier():
        raise UsageError(f"--model {spec}: expected 'path/to/file.py:function' or 'package.module:function'")
    try:
        if location.endswith(".py"):
            path = Path(location)
            if not path.is_file():
                raise InputError(f"--model {spec}: no such file {location}")
            module_spec = importlib.util.spec_from_file_location(f"cafa_user_model_{path.stem}", path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(location)
    except InputError:
        raise
    except SystemExit as error:  # a script's argparse or sys.exit: exit 0 here would tell CI the run succeeded
        raise InputError(f"--model {spec}: importing {location} called sys.exit({error.code!r}) (argparse or a script's main "
                         f"at import?); keep it under if __name__ == '__main__':") from None
    except Exception as error:  # a user's file can fail in any way; report it on one line
        raise InputError(f"--model {spec}: could not import {location} ({type(error).__name__}: {error})") from None
    factory = getattr(module, function, None)
    if not callable(factory):
        raise InputError(f"--model {spec}: {location} has no function {function}")
    try:
        model = factory(num_classes=num_classes) if num_classes is not None else factory()
    except (Exception, SystemExit) as error:
        raise InputError(f"--model {spec}: {function}() failed ({type(error).__name__}: {error})") from None
    if not isinstance(model, nn.Module):
        raise InputError(f"--model {spec}: {function}() returned {type(model).__name__}, not a torch nn.Module")
    return model


def sha256_of(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_step_counter(name: str) -> bool:
    """BatchNorm's num_batches_tracked: it counts training steps and changes nothing the
    model computes; old torchvision and converted checkpoints lack it."""
    return name.endswith("num_batches_tracked")


def parameters_sha256(module: nn.Module) -> str:
    """A fingerprint of the values the features depend on, whatever file they came from;
    docs/artifact-format.md specifies it byte for byte."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        if not isinstance(tensor, torch.Tensor) or is_step_counter(name):  # extra state of a module is not a tensor
            continue
        shape = ",".join(str(n) for n in tensor.shape)
        digest.update(f"{name} {str(tensor.dtype).removeprefix('torch.')} [{shape}]\n".encode())
        raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        if sys.byteorder == "big":  # the bytes as a little-endian machine holds them
            raw = raw.reshape(-1, tensor.element_size() // (2 if tensor.is_complex() else 1)).flip(1).reshape(-1)
        digest.update(raw.numpy())
    return digest.hexdigest()


def check_weights_file(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"--weights {path}: " + ("a folder; give the weights file in it" if path.is_dir() else "no such file"))
    return path


def read_state_dict(path: str | Path, trust_checkpoint: bool = False) -> dict[str, torch.Tensor]:
    """A state_dict from .safetensors or a torch checkpoint, unwrapped and de-prefixed."""
    path = check_weights_file(path)
    with open(path, "rb") as f:
        start = f.read(512)
    head = start.lstrip().lower()
    if head.startswith(HTML_MARKERS):
        raise InputError(f"--weights {path}: this is a web page, not a checkpoint (the download saved HTML); download the file itself")
    if head.startswith(LFS_POINTER):
        raise InputError(
            f"--weights {path}: this is a Git LFS pointer, not the weights (the clone did not fetch them); "
            f"run git lfs pull in that repository, or download the file itself"
        )
    if path.suffix.lower() == ".safetensors" or _looks_like_safetensors(start, path.stat().st_size):  # the bytes decide, as for images
        from safetensors import SafetensorError

        try:
            with open_safetensors(path) as f:
                if (f.metadata() or {}).get("format") == "cafa-stats":
                    raise InputError(f"--weights {path}: this is a cafa statistics artifact, not model weights (cafa adapt takes it as --stats)")
                state = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (a safe_open handle is not a dict)
        except (SafetensorError, OSError, ValueError) as error:
            raise InputError(f"--weights {path}: not a readable safetensors file ({error})") from None
    else:
        state = _torch_load(path, trust_checkpoint)
    return _unwrap(state, path)


def _looks_like_safetensors(start: bytes, size: int) -> bool:
    """safetensors' layout: an 8-byte little-endian header length, then the JSON header."""
    return len(start) >= 9 and start[8:9] == b"{" and 2 <= int.from_bytes(start[:8], "little") <= size - 8


def _torch_load(path: Path, trust_checkpoint: bool):
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols on stderr; the error below says it all
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=not trust_checkpoint)
    except pickle.UnpicklingError as error:
        start = _first_bytes(path)
        if trust_checkpoint and start in PLAIN_PICKLE:
            raise _ran_plain_pickle(path) from None
        # "Unsupported operand": the bytes are not a pickle torch reads, so trusting them cannot help;
        # nor can it for a file torch.save did not write (text read as pickle opcodes names odd "globals")
        if "weights_only" in str(error) and "Unsupported operand" not in str(error) and start.startswith(TORCH_SAVE_MARKERS):
            raise InputError(
                f"--weights {path}: the checkpoint holds Python objects beyond tensors, and loading them "
                f"can run arbitrary code; if you trust its source, pass --trust-checkpoint (or re-save it as a state_dict)"
            ) from None
        if start in PLAIN_PICKLE:
            raise InputError(
                f"--weights {path}: a plain Python pickle, not a torch checkpoint, and unpickling it could run "
                f"arbitrary code; save the weights with torch.save(model.state_dict(), ...) or as .safetensors"
            ) from None
        raise _not_a_checkpoint(path, error) from None
    except (ImportError, AttributeError) as error:
        # only a trusted load imports: a whole pickled model whose code is not on this machine
        detail = str(error).splitlines()[0][:200] if str(error) else ""
        if trust_checkpoint and detail and detail.isprintable():
            raise InputError(
                f"--weights {path}: the checkpoint pickles objects whose code is not importable here ({detail}); "
                f"where that code is, re-save the weights with torch.save(model.state_dict(), ...)"
            ) from None
        raise _not_a_checkpoint(path, error) from None
    except MemoryError as error:
        if path.stat().st_size >= SMALL_FILE:
            raise  # a real shortage: the CLI reports it as out of memory
        raise _not_a_checkpoint(path, error) from None
    except Exception as error:  # bytes read as pickle opcodes fail in any way: KeyError, IndexError, struct.error...
        if trust_checkpoint and _first_bytes(path) in PLAIN_PICKLE:
            raise _ran_plain_pickle(path) from None
        raise _not_a_checkpoint(path, error) from None


def _ran_plain_pickle(path: Path) -> InputError:
    return InputError(
        f"--weights {path}: a plain Python pickle, not a torch checkpoint; --trust-checkpoint unpickled it, "
        f"so any code it carries has run; save the weights with torch.save(model.state_dict(), ...) or as .safetensors"
    )


def _first_bytes(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(2)


def _not_a_checkpoint(path: Path, error: BaseException) -> InputError:
    name = type(error).__name__
    if name == "error":  # struct.error: a bare "(error)" would read as a typo
        name = f"{type(error).__module__}.error"
    return InputError(f"--weights {path}: this is not a checkpoint torch can read ({name})")


def _unwrap(state, path: Path) -> dict[str, torch.Tensor]:
    if isinstance(state, nn.Module):
        state = state.state_dict()
    for key in ("state_dict", "model", "model_state_dict", "net"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
            break
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise InputError(f"--weights {path}: expected a state_dict (names -> tensors), found {type(state).__name__}")
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}
    return state


def load_weights(model: nn.Module, state: dict[str, torch.Tensor], path: str) -> None:
    own = model.state_dict()
    missing = sorted(k for k in set(own) - set(state) if not is_step_counter(k))  # the model keeps its own counters
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {listing(missing, 6)}")
        if unexpected:
            parts.append(f"unexpected {listing(unexpected, 6)}")
        raise InputError(f"--weights {path}: keys do not match the model: {'; '.join(parts)}; check --model and --num-classes")
    odd = [f"{k} ({_kind(v)})" for k, v in state.items() if k in own and _kind(v)]
    if odd:  # load_state_dict fails on them with a long message, or drops imaginary parts with a warning
        raise InputError(f"--weights {path}: {listing(odd, 3)}: not a dense real tensor; save the weights as a plain state dict "
                         f"(tensor.to_dense(), real parts)")
    wrong = [f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}" for k, v in own.items() if k in state and state[k].shape != v.shape]
    if wrong:
        raise InputError(f"--weights {path}: shapes do not match the model: {', '.join(wrong[:3])}; check --model and --num-classes")
    model.load_state_dict(state, strict=False)  # every key was checked above


def _kind(tensor) -> str | None:
    """What makes a checkpoint tensor unloadable as model weights, or None."""
    if not isinstance(tensor, torch.Tensor):
        return type(tensor).__name__
    if tensor.layout != torch.strided:
        return "sparse"
    if tensor.is_meta:
        return "meta: no values"
    if tensor.is_complex():
        return "complex"
    return None


def find_classifier(model: nn.Module, name: str | None = None) -> tuple[str, nn.Linear]:
    """The final nn.Linear: `fc` in ResNets, `classifier.N` in EfficientNet/MobileNet,
    `heads.head` in ViT — the last Linear in registration order, or `name`."""
    modules = dict(model.named_modules())
    if name is not None:
        layer = modules.get(name)
        if not isinstance(layer, nn.Linear):
            linears = [n for n, m in modules.items() if isinstance(m, nn.Linear)]
            raise UsageError(
                f"--classifier {name}: no nn.Linear of that name"
                + (f" (linear layers: {', '.join(linears[-5:])})" if linears else "")
            )
        return name, layer
    linears = [(n, m) for n, m in modules.items() if isinstance(m, nn.Linear)]
    if not linears:
        raise InputError("the model has no nn.Linear classifier layer; CAFA needs the features that enter one (see --classifier)")
    return linears[-1]


class FeatureClassifier(nn.Module):
    """Wraps a classifier so that forward returns (logits, features)."""

    def __init__(self, model: nn.Module, classifier_name: str | None = None):
        super().__init__()
        self.model = model
        self.classifier_name, self.classifier = find_classifier(model, classifier_name)
        self._features: torch.Tensor | None = None
        self._in_forward = False
        self.classifier.register_forward_pre_hook(self._keep_features)

    def _keep_features(self, module, inputs):
        # only inside our own forward: a call to the bare net, or through a second wrapper
        # of it, would otherwise leave features (and their graph) held here until our next call
        if self._in_forward:
            self._features = inputs[0]

    @property
    def feature_dim(self) -> int:
        return self.classifier.in_features

    @property
    def num_classes(self) -> int:
        return self.classifier.out_features

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._in_forward = True
        try:
            logits = self.model(x)
        except DEVICE_FAILURES:
            raise  # the GPU's, not the images': out of memory, a CUDA or cuDNN error
        except (RuntimeError, AssertionError) as error:
            # a shape or channel mismatch surfaces deep inside a layer (torchvision's ViT
            # asserts its image size); say which input it was
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            weights = next((p.dtype for p in self.model.parameters()), x.dtype)
            if x.dtype != weights:  # only through the Python API: the CLI's batches are float32, as checked models are
                raise InputError(f"the images are {x.dtype} but the model's weights are {weights}: give images of the "
                                 f"weights' dtype ({first_line})") from error
            raise InputError(
                f"the model cannot take these images (a batch of shape {list(x.shape)}): {first_line}; "
                f"check --channels, --resize and --crop against the input the model expects"
            ) from error
        finally:
            self._in_forward = False
            features, self._features = self._features, None
        if features is None:
            raise InputError(f"the classifier layer {self.classifier_name} was not called in the forward pass; name the right one with --classifier")
        if features.dim() != 2:
            raise InputError(
                f"the features entering {self.classifier_name} have shape {tuple(features.shape)}, not [batch, dim]; "
                f"name a classifier that takes pooled features with --classifier"
            )
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or len(logits) != len(x) or not logits.is_floating_point():
            shape = f"a {type(logits).__name__}" if not isinstance(logits, torch.Tensor) else f"{logits.dtype} of shape {list(logits.shape)}"
            raise InputError(f"the model returns {shape} for a batch of {len(x)}, not float logits [batch, classes]; "
                             f"give a factory whose forward returns the logits only")
        if logits.shape[1] != self.num_classes:
            raise InputError(f"the model returns {logits.shape[1]} logits but {self.classifier_name} has {self.num_classes} outputs, "
                             f"so it is not the layer that makes the logits; name that one with --classifier")
        return logits, features


def canonical_model(model: str) -> str:
    """`--model` as an artifact records it: a factory file by its absolute path (as the
    weights), so that adapt works from any folder and `net.py:build` names the same model."""
    location, _, function = model.rpartition(":")
    if location.endswith(".py"):
        return f"{Path(location).resolve()}:{function}"
    return model


def resolve(
    model: str,
    weights: str | None = None,
    num_classes: int | None = None,
    classifier: str | None = None,
    trust_checkpoint: bool = False,
) -> tuple[FeatureClassifier, ModelSpec]:
    """Build, load and wrap a model; return it (eval mode, CPU) with its reproducible spec."""
    if num_classes is not None and num_classes < 1:
        raise UsageError(f"--num-classes must be at least 1, not {num_classes}")
    net = build_model(model, num_classes)
    if weights is not None:
        load_weights(net, read_state_dict(weights, trust_checkpoint), weights)
    wrapped = FeatureClassifier(net, classifier).eval()
    if num_classes is not None and wrapped.num_classes != num_classes:
        raise UsageError(f"--num-classes {num_classes} but the model's classifier has {wrapped.num_classes} outputs")
    spec = ModelSpec(canonical_model(model), absolute(weights), weights_sha256(model, weights), num_classes, wrapped.classifier_name)
    return wrapped, spec


def factory_sha256(model: str) -> str | None:
    """The SHA-256 of the file of a `file.py:fn` model (its code), else None."""
    location, _, _ = model.rpartition(":")
    return sha256_of(location) if location.endswith(".py") and Path(location).is_file() else None


def weights_sha256(model: str, weights: str | None) -> str | None:
    """What an artifact records to notice changed weights: the sha256 of the weights file,
    or of a bundled model's packaged weights (a newer cafa may retrain them); else None."""
    if weights is not None:
        return sha256_of(weights)
    bundled = bundled_model(model)
    return sha256_of(bundled.weights) if bundled is not None else None


def pick_device(device: str | torch.device) -> torch.device:
    """`auto` → cuda when present; `cuda[:N]` without CUDA is a usage error, not a crash."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(device)
    except RuntimeError:
        raise UsageError(f"--device {device}: expected auto, cpu, cuda or cuda:N") from None
    if chosen.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {device}: CUDA is not available on this machine; use --device cpu or auto")
        if chosen.index is not None and chosen.index >= torch.cuda.device_count():
            raise UsageError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) here")
    elif chosen.type != "cpu":
        raise UsageError(f"--device {device}: expected auto, cpu, cuda or cuda:N")
    return chosen


def bundled_model(model: str | None):
    """The bundled model of this name (its weights, class names, preprocessing and training
    data), else None."""
    from cafa_cli.zoo import BUNDLED

    return BUNDLED.get(model)

