"""Reading weights safely: safetensors, or torch.load with weights_only=True; a file
that is not a checkpoint (an HTML page, a Git LFS pointer, a plain pickle) is named as such."""

from __future__ import annotations

import hashlib
import pickle
import warnings
import zipfile
from pathlib import Path

import torch
from torch import nn

from cafa_cli.core.errors import InputError, listing, out_of_memory
from cafa_cli.core.files import open_safetensors, reading
from cafa_cli.model.file_kinds import (
    ADAPTER_STATE_FAMILY,
    ADAPTER_STATE_HINT,
    HTML_MARKERS,
    LFS_POINTER,
    PLAIN_PICKLE,
    SMALL_FILE,
    TORCH_SAVE_MARKERS,
)


def is_step_counter(name: str) -> bool:
    """BatchNorm's num_batches_tracked: it counts training steps and changes nothing the
    model computes; old torchvision and converted checkpoints lack it."""
    return name.endswith("num_batches_tracked")


# torch.save stores a checkpoint's entries uncompressed, and float weights barely compress;
# a zip entry that expands more than this (deflated zeros: a thousandfold) is a bomb, and
# torch would allocate all that it announces
MAX_EXPANSION = 10


def sha256_of(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_weights_file(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise InputError(
            f"`weights` {path}: " + ("a folder; give the weights file in it" if path.is_dir() else "no such file")
        )
    return path


class UntrustedCheckpoint(InputError):
    """A checkpoint that only loads by unpickling Python objects, which can run code."""


def read_state_dict(path: str | Path, trust_checkpoint: bool = False) -> dict[str, torch.Tensor]:
    """A state_dict from .safetensors or a torch checkpoint, unwrapped and de-prefixed."""
    path = check_weights_file(path)
    reading(path, "`weights`")
    with open(path, "rb") as f:
        start = f.read(512)
    head = start.lstrip().lower()
    if head.startswith(HTML_MARKERS):
        raise InputError(
            f"`weights` {path}: this is a web page, not a checkpoint (the download saved HTML); download the file "
            "itself"
        )
    if head.startswith(LFS_POINTER):
        raise InputError(
            f"`weights` {path}: this is a Git LFS pointer, not the weights (the clone did not fetch them); "
            f"run git lfs pull in that repository, or download the file itself"
        )
    if path.suffix.lower() == ".safetensors" or _looks_like_safetensors(
        start, path.stat().st_size
    ):  # the bytes decide, as for images
        from safetensors import SafetensorError

        try:
            with open_safetensors(path) as f:
                if (f.metadata() or {}).get("format") == "cafa-stats":
                    raise InputError(
                        f"`weights` {path}: this is a cafa statistics artifact, not model weights (cafa adapt takes "
                        "it as `stats`)"
                    )
                state = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (a safe_open handle is not a dict)
        except (SafetensorError, OSError, ValueError) as error:
            raise InputError(f"`weights` {path}: not a readable safetensors file ({error})") from None
    else:
        state = _torch_load(path, trust_checkpoint)
    return _unwrap(state, path)


def _looks_like_safetensors(start: bytes, size: int) -> bool:
    """safetensors' layout: an 8-byte little-endian header length, then the JSON header."""
    return len(start) >= 9 and start[8:9] == b"{" and 2 <= int.from_bytes(start[:8], "little") <= size - 8


def _torch_load(path: Path, trust_checkpoint: bool):
    check_expansion(path)
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
        if (
            "weights_only" in str(error)
            and "Unsupported operand" not in str(error)
            and start.startswith(TORCH_SAVE_MARKERS)
        ):
            raise UntrustedCheckpoint(
                f"`weights` {path}: the checkpoint holds Python objects beyond tensors, and loading them "
                "can run arbitrary code; if you trust its source, pass `trust_checkpoint` (or re-save it as a "
                "state_dict)"
            ) from None
        if start in PLAIN_PICKLE:
            raise InputError(
                f"`weights` {path}: a plain Python pickle, not a torch checkpoint, and unpickling it could run "
                f"arbitrary code; save the weights with torch.save(model.state_dict(), ...) or as .safetensors"
            ) from None
        raise _not_a_checkpoint(path, error) from None
    except (ImportError, AttributeError) as error:
        # only a trusted load imports: a whole pickled model whose code is not on this machine
        detail = str(error).splitlines()[0][:200] if str(error) else ""
        if trust_checkpoint and detail and detail.isprintable():
            raise InputError(
                f"`weights` {path}: the checkpoint pickles objects whose code is not importable here ({detail}); "
                f"where that code is, re-save the weights with torch.save(model.state_dict(), ...)"
            ) from None
        raise _not_a_checkpoint(path, error) from None
    except Exception as error:  # bytes read as pickle opcodes fail in any way: KeyError, IndexError, struct.error...
        if out_of_memory(error) and path.stat().st_size >= SMALL_FILE:
            raise  # a real shortage: the CLI reports it as out of memory
        if trust_checkpoint and _first_bytes(path) in PLAIN_PICKLE:
            raise _ran_plain_pickle(path) from None
        raise _not_a_checkpoint(path, error) from None


def check_expansion(
    path: Path,
    option: str = "weights",
    fix: str = "torch.save stores tensors uncompressed: re-save the weights with torch.save",
) -> None:
    """Refuse a zip archive (torch.save's) whose compressed entries announce far more bytes than
    they hold, before torch decompresses them (a 1 MB file could take a GB)."""
    try:
        with zipfile.ZipFile(path) as archive:
            packed = [entry for entry in archive.infolist() if entry.compress_type != zipfile.ZIP_STORED]
    except Exception:  # not a zip, or a damaged one: torch.load says what it is
        return
    expanded, held = sum(entry.file_size for entry in packed), sum(entry.compress_size for entry in packed)
    if expanded > MAX_EXPANSION * held + SMALL_FILE:
        raise InputError(
            f"`{option}` {path}: a zip archive whose compressed entries would expand "
            f"{expanded // max(held, 1):,}-fold, to {expanded:,} bytes from {held:,} (a decompression bomb?); {fix}"
        )


def _ran_plain_pickle(path: Path) -> InputError:
    return InputError(
        f"`weights` {path}: a plain Python pickle, not a torch checkpoint; `trust_checkpoint` unpickled it, "
        f"so any code it carries has run; save the weights with torch.save(model.state_dict(), ...) or as .safetensors"
    )


def _first_bytes(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(2)


def _not_a_checkpoint(path: Path, error: BaseException) -> InputError:
    name = type(error).__name__
    if name == "error":  # struct.error: a bare "(error)" would read as a typo
        name = f"{type(error).__module__}.error"
    return InputError(f"`weights` {path}: this is not a checkpoint torch can read ({name})")


def _unwrap(state, path: Path) -> dict[str, torch.Tensor]:
    if isinstance(state, dict) and str(state.get("format", "")).startswith(ADAPTER_STATE_FAMILY):
        raise InputError(f"`weights` {path}: an adaptation state cafa adapt saved, not weights: {ADAPTER_STATE_HINT}")
    if isinstance(state, nn.Module):
        state = state.state_dict()
    for key in ("state_dict", "model", "model_state_dict", "net"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
            break
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise InputError(f"`weights` {path}: expected a state_dict (names -> tensors), found {type(state).__name__}")
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module.") :]: v for k, v in state.items()}
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
        raise InputError(
            f"`weights` {path}: keys do not match the model: {'; '.join(parts)}; check `model` and `num_classes`"
        )
    odd = [f"{k} ({_kind(v)})" for k, v in state.items() if k in own and _kind(v)]
    if odd:  # load_state_dict fails on them with a long message, or drops imaginary parts with a warning
        raise InputError(
            f"`weights` {path}: {listing(odd, 3)}: not a dense real tensor; save the weights as a plain state dict "
            f"(tensor.to_dense(), real parts)"
        )
    integer = [
        f"{k} ({str(state[k].dtype).removeprefix('torch.')})"
        for k, v in own.items()
        if k in state and isinstance(v, torch.Tensor) and v.is_floating_point() and not state[k].is_floating_point()
    ]
    if (
        integer
    ):  # load_state_dict casts them (int32 3 is 3.0) and every prediction is garbage; quantized ones fail in it
        raise InputError(
            f"`weights` {path}: {listing(integer, 3)}: not floating-point, for floating-point parameters of the model; "
            f"give the float weights (dequantize a quantized checkpoint: tensor.dequantize())"
        )
    wrong = [
        f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}"
        for k, v in own.items()
        if k in state and state[k].shape != v.shape
    ]
    if wrong:
        raise InputError(
            f"`weights` {path}: shapes do not match the model: {', '.join(wrong[:3])}; check `model` and `num_classes`"
        )
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
