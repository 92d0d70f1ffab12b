"""Models that a library builds by name (`torchvision:NAME`, `timm:NAME`; `openclip:NAME` in
model/openclip.py), their pretrained weights found in the local cache (never downloaded), and
the preprocessing those weights declare.

torchvision keeps its weights in `$TORCH_HOME/hub/checkpoints` under the file name of
the weights' URL, whose `-<hex>.` part is the start of the file's sha256; timm keeps
them in the Hugging Face hub cache (`$HF_HUB_CACHE`), or in torch's folder for the few
that come from a URL. The file is read by cafa's own safe reader (model/checkpoints.py) and
handed to the library's builder, so that whatever the builder does with pretrained
weights (torchvision's inception sets `transform_input`, timm adapts a classifier of
another size) is what happens here too.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch
from torch import nn

from cafa_cli.core.errors import InputError, UsageError, did_you_mean, listing
from cafa_cli.data.values import INTERPOLATIONS
from cafa_cli.model.checkpoints import read_state_dict, sha256_of

# what a weights *file* is called; anything else without a folder in it may be a name
WEIGHT_FILE_SUFFIXES = (".pt", ".pth", ".safetensors", ".bin", ".ckpt", ".tar", ".pkl")
TIMM_MISSING = "needs timm, which is not installed: pip install 'cafa-cli[timm]'"
HASH_IN_NAME = re.compile(r"-([a-f0-9]+)\.")  # torch.hub's HASH_REGEX: resnet50-11ad3fa6.pth


@dataclass(frozen=True)
class CachedWeights:
    """Pretrained weights by name, found in the local cache."""

    name: str  # as the artifact records it: ResNet50_Weights.IMAGENET1K_V2, or a timm tag (a1_in1k)
    path: Path
    sha256: str


def library_of(model: str) -> tuple[str | None, str]:
    """('timm', 'torchvision' or 'openclip', NAME) for `timm:NAME` / `torchvision:NAME` /
    `openclip:NAME` (model/openclip.py), else (None, model)."""
    for library in ("timm", "torchvision", "openclip"):
        if model.startswith(f"{library}:"):
            return library, model[len(library) + 1 :]
    return None, model


def is_weights_name(weights: str) -> bool:
    """`--weights IMAGENET1K_V2`, not a file: no such file, no folder in it, no file suffix."""
    return (
        not Path(weights).exists()
        and "/" not in weights
        and os.sep not in weights
        and not weights.lower().endswith(WEIGHT_FILE_SUFFIXES)
    )


# --- torchvision --------------------------------------------------------------


def torchvision_names() -> list[str]:
    import torchvision

    return torchvision.models.list_models(module=torchvision.models)


def torchvision_weights(name: str, weights: str):
    """The weights enum member `weights` names for architecture `name`: IMAGENET1K_V2,
    DEFAULT, or ResNet50_Weights.IMAGENET1K_V2."""
    import torchvision

    try:
        enum = torchvision.models.get_model_weights(name)
    except (ValueError, KeyError):
        raise UsageError(
            f"`weights` {weights}: torchvision publishes no weights for {name}; give a weights file"
        ) from None
    prefix, dot, tag = weights.rpartition(".")
    if dot and prefix != enum.__name__:
        raise UsageError(
            f"`weights` {weights} are not {name}'s; its weights are {enum.__name__}.<{'|'.join(enum.__members__)}>"
        )
    try:
        return enum[tag]
    except KeyError:
        raise UsageError(
            f"`weights` {weights}: no such file, nor weights of {name} by that name"
            f"{did_you_mean(tag, list(enum.__members__))}; torchvision has {', '.join(enum.__members__)}"
        ) from None


def cached_torchvision_weights(member) -> CachedWeights:
    """The file of a torchvision weights enum member in torch's hub cache, its sha256
    checked against the prefix in its name."""
    path = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(member.url)
    name = f"{type(member).__name__}.{member.name}"
    return CachedWeights(
        name,
        path,
        checked_file(
            path,
            name,
            f"torch's hub cache {path.parent} ($TORCH_HOME/hub/checkpoints)",
            f"python -c \"import torchvision; torchvision.models.get_weight('{name}').get_state_dict()\"",
        ),
    )


def checked_file(path: Path, name: str, cache: str, fetch: str) -> str:
    """The sha256 of a cached weights file, checked against the hash torch.hub puts in the name."""
    if not path.is_file():
        raise InputError(
            f"`weights` {name}: {path.name} is not in {cache}; cafa downloads nothing: fetch it where there is a "
            f"network ({fetch}) and copy it to {path}"
        )
    digest = sha256_of(path)
    expected = HASH_IN_NAME.search(path.name)
    if expected and not digest.startswith(expected.group(1)):
        raise InputError(
            f"`weights` {name}: {path} has sha256 {digest[:12]}..., not the {expected.group(1)}... its name promises "
            f"(a partial or altered download); delete it and fetch it again"
        )
    return digest


def build_torchvision(name: str, kwargs: dict, weights: CachedWeights | None = None) -> nn.Module:
    """torchvision's builder of `name`; with `weights`, given the enum member as a user of
    torchvision would, its state dict read from the cached file by cafa's safe reader."""
    import torchvision

    if name not in torchvision_names():
        raise UsageError(
            f"`model` torchvision:{name}: no such torchvision classification "
            f"model{did_you_mean(name, torchvision_names())}"
        )
    if weights is None:
        return built(f"torchvision:{name}", lambda: torchvision.models.get_model(name, weights=None, **kwargs))
    member = torchvision.models.get_weight(weights.name)
    state = read_state_dict(weights.path)
    # the builder reads the weights through this method (torch.hub, which would download
    # a missing file and unpickles without weights_only): it gets the state read above
    with mock.patch.object(type(member), "get_state_dict", lambda self, *args, **options: state):
        return built(f"torchvision:{name}", lambda: torchvision.models.get_model(name, weights=member, **kwargs))


def torchvision_preprocessing(member) -> dict:
    """The preprocessing a torchvision weights enum declares (its transforms())."""
    transform = member.transforms()
    resize = getattr(transform, "resize_size", None)
    crop = getattr(transform, "crop_size", None)
    interpolation = getattr(transform, "interpolation", None)
    return {
        "resize": int(resize[0]) if resize else None,
        "crop": int(crop[0]) if crop else None,
        "mean": tuple(float(v) for v in transform.mean),
        "std": tuple(float(v) for v in transform.std),
        "channels": 3,
        "interpolation": interpolation.value if interpolation is not None else "bilinear",
    }


# --- timm ----------------------------------------------------------------------


def import_timm(model: str):
    try:
        import timm
    except ImportError:
        raise UsageError(f"`model` {model} {TIMM_MISSING}") from None
    return timm


def timm_config(name: str, tag: str | None = None):
    """timm's pretrained config of NAME (NAME.TAG), checked: the model and the tag exist."""
    timm = import_timm(f"timm:{name}")
    architecture, _, own_tag = name.partition(".")
    if not timm.is_model(architecture):
        raise UsageError(f"`model` timm:{name}: no such timm model{did_you_mean(architecture, timm.list_models())}")
    if tag and own_tag and tag != own_tag:
        raise UsageError(
            f"`model` timm:{name} names the pretrained tag {own_tag}, and `weights` {tag}; give the tag once"
        )
    given = f"`weights` {tag}: no such file, nor" if tag else f"`model` timm:{name}: {own_tag} is not"
    tag = tag or own_tag
    try:
        config = timm.get_pretrained_cfg(f"{architecture}.{tag}" if tag else architecture)
    except RuntimeError:  # timm 1.x for an unknown tag ("Invalid pretrained tag"); earlier versions return None
        config = None
    if config is None:
        tags = [known.partition(".")[2] for known in timm.list_pretrained(f"{architecture}.*")]
        raise UsageError(
            f"{given} a pretrained tag of timm's {architecture}{did_you_mean(tag, tags)}"
            + (f"; its tags: {listing(tags, 8)}" if tags else "")
        )
    return config


def cached_timm_weights(name: str, tag: str | None) -> CachedWeights:
    """The cached file of timm's pretrained NAME.TAG: in the Hugging Face hub cache
    (model.safetensors preferred, as timm does), else torch's for a URL."""
    config = timm_config(name, tag)
    recorded = config.tag or ""
    if config.hf_hub_id:
        from huggingface_hub import constants, try_to_load_from_cache

        files = (
            [config.hf_hub_filename]
            if config.hf_hub_filename
            else ["model.safetensors", "open_clip_model.safetensors", "pytorch_model.bin"]
        )
        for file in files:
            found = try_to_load_from_cache(config.hf_hub_id, file, cache_dir=constants.HF_HUB_CACHE)
            if isinstance(found, str):
                return CachedWeights(recorded, Path(found), checked_blob(Path(found), recorded))
        folder = Path(constants.HF_HUB_CACHE) / f"models--{config.hf_hub_id.replace('/', '--')}"
        raise InputError(
            f"`weights` {recorded}: timm's {config.hf_hub_id} ({' or '.join(files)}) is not in the Hugging Face "
            f"hub cache {constants.HF_HUB_CACHE} (looked in {folder}); cafa downloads nothing: fetch it where there "
            f"is a network (python -c \"import timm; timm.create_model('{config.architecture}.{recorded}', "
            f'pretrained=True)") and copy that folder there, or set HF_HUB_CACHE'
        )
    if config.url:
        path = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(config.url)
        return CachedWeights(
            recorded,
            path,
            checked_file(
                path,
                recorded,
                f"torch's hub cache {path.parent}",
                f"timm.create_model('{config.architecture}.{recorded}', pretrained=True)",
            ),
        )
    raise UsageError(
        f"`weights` {recorded}: timm publishes no file for {config.architecture}.{recorded}; give a weights file"
    )


def checked_blob(path: Path, name: str) -> str:
    """The sha256 of a Hugging Face cache file, checked against its blob's name: the hub
    stores a large (LFS) file under its sha256 and links the snapshot's name to it."""
    digest, blob = sha256_of(path), path.resolve()
    if re.fullmatch("[0-9a-f]{64}", blob.name) and blob.name != digest:
        raise InputError(
            f"`weights` {name}: {blob} has sha256 {digest[:12]}..., not the {blob.name[:12]}... its name promises "
            f"(a partial or altered download); delete it and fetch it again"
        )
    return digest


def build_timm(name: str, kwargs: dict, weights: CachedWeights | None = None) -> nn.Module:
    """timm.create_model(NAME[.TAG]); with `weights`, as pretrained, from the cached file
    read by cafa's safe reader (timm adapts it: a classifier of another size, in_chans)."""
    timm = import_timm(f"timm:{name}")
    config = timm_config(name, weights.name if weights else None)
    full = f"{config.architecture}.{config.tag}" if config.tag else config.architecture
    if weights is None:
        return built(f"timm:{name}", lambda: timm.create_model(full, pretrained=False, **kwargs))
    outputs = kwargs.get("num_classes")
    if outputs is not None and config.num_classes and outputs != config.num_classes:
        # timm would load the rest and leave a fresh random head: predictions would be noise,
        # and another head every run (adapt could not rebuild the model the artifact records)
        raise UsageError(
            f"`model` timm:{name} with `weights` {weights.name} has {config.num_classes} outputs, and `num_classes` "
            f"{outputs} would put an untrained, random classifier on it; leave `num_classes` out, or give "
            f"`weights` a state dict file trained for {outputs} classes"
        )
    state = read_state_dict(weights.path)
    net = built(
        f"timm:{name}",
        lambda: timm.create_model(full, pretrained=True, pretrained_cfg_overlay={"state_dict": state}, **kwargs),
    )
    getattr(net, "pretrained_cfg", {}).pop(
        "state_dict", None
    )  # the model keeps its config: not a second copy of the weights
    return net


def timm_preprocessing(name: str, tag: str | None, kwargs: dict) -> dict:
    """The preprocessing timm's pretrained config declares, as timm's eval transform
    applies it: resize the shorter side to input/crop_pct, centre crop the input size.
    An `img_size` or `in_chans` among the model's arguments changes the input."""
    config = timm_config(name, tag)
    channels, height, _ = config.input_size
    size = kwargs.get("img_size", height)
    size = int(size[0] if isinstance(size, (tuple, list)) else size)
    crop_pct = config.crop_pct or 1.0
    interpolation = config.interpolation if config.interpolation in INTERPOLATIONS else "bicubic"  # timm's own fallback
    return {
        "resize": int(math.floor(size / crop_pct)),
        "crop": size,
        "mean": tuple(float(v) for v in config.mean),
        "std": tuple(float(v) for v in config.std),
        "channels": int(kwargs.get("in_chans", channels)),
        "interpolation": interpolation,
    }


def built(model: str, build):
    """The library's model, or its failure in one line (a keyword it does not take, weights
    that do not fit it)."""
    try:
        return build()
    except UsageError:
        raise
    except TypeError as error:
        raise UsageError(f"`model` {model}: {_first_line(error)}; check `model_arg`") from None
    except Exception as error:  # a library's checks raise whatever they like (ValueError, AssertionError, RuntimeError)
        raise InputError(
            f"`model` {model}: could not be built ({type(error).__name__}: {_first_line(error)}); check `model_arg`, "
            f"`num_classes` and `weights`"
        ) from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__
