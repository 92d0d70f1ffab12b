"""CLIP models by name (`openclip:ARCH`, open_clip): an architecture open_clip knows
(`openclip:ViT-B-32`) or a model config file (`openclip:tiny.json`: open_clip's model config,
as in its model_configs/, or an open_clip_config.json with `model_cfg` and `preprocess_cfg`),
with weights from a file or a pretrained tag found in the local cache, never downloaded; built
as the zero-shot classifier of the classes the user names (model/clip.py).

open_clip's own builder would fetch what is missing (a tag's weights, a tower's pretrained
weights), and reads a checkpoint with torch.load: here the model is built from its config
with no tower weights, and the checkpoint, read by cafa's safe reader, goes through open_clip's
load_checkpoint (which converts third-party layouts and resizes position embeddings)."""

from __future__ import annotations

import json
import os
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

from cafa_cli.core.errors import InputError, UsageError, did_you_mean, listing
from cafa_cli.core.files import read_small_text
from cafa_cli.data.values import INTERPOLATIONS
from cafa_cli.model.checkpoints import read_state_dict, sha256_of
from cafa_cli.model.clip import Prompting, ZeroShotClassifier, import_open_clip, zero_shot_classifier
from cafa_cli.model.hub import CachedWeights, built, checked_blob, checked_file

PREFIX = "openclip:"
CONFIG_LIMIT = 1 << 20


def is_openclip(model: str | None) -> bool:
    return bool(model) and model.startswith(PREFIX)


@dataclass(frozen=True)
class Architecture:
    """An open_clip architecture: its model config, and the preprocessing a config file declares."""

    name: str  # as `openclip:NAME` gives it
    config: dict  # open_clip's model config: embed_dim, vision_cfg, text_cfg, ...
    preprocess: dict  # a config file's preprocess_cfg (open_clip's keys: size, mean, std, interpolation, ...)
    known: bool  # one of open_clip's own, which has pretrained tags


def architecture(name: str) -> Architecture:
    """`name`'s config: open_clip's (its list_models()), or a .json file's."""
    open_clip = import_open_clip(PREFIX + name)
    if name.lower().endswith(".json"):
        return _config_file(name)
    # a name with a schema (hf-hub:, local-dir:) would make open_clip fetch or read elsewhere
    if name not in open_clip.list_models():
        raise UsageError(
            f"`model` {PREFIX}{name}: no such open_clip architecture{did_you_mean(name, open_clip.list_models())}; "
            f"give one of open_clip.list_models() (ViT-B-32, ViT-B-16, RN50, ...), or a model config file "
            f"{PREFIX}FILE.json"
        )
    return Architecture(name, open_clip.get_model_config(name), {}, True)


def _config_file(name: str) -> Architecture:
    fix = 'give open_clip\'s model config JSON {"embed_dim", "vision_cfg", "text_cfg"} (or {"model_cfg": ...})'
    if not Path(name).is_file():
        raise InputError(f"`model` {PREFIX}{name}: no such file; {fix}")
    text = read_small_text(name, f"`model` {PREFIX}", CONFIG_LIMIT, fix)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise InputError(f"`model` {PREFIX}{name}: not JSON ({error.msg}, line {error.lineno}); {fix}") from None
    config = data.get("model_cfg", data) if isinstance(data, dict) else None
    if not isinstance(config, dict) or not all(isinstance(config.get(k), dict) for k in ("vision_cfg", "text_cfg")):
        raise InputError(f"`model` {PREFIX}{name}: no vision_cfg and text_cfg objects; {fix}")
    preprocess = data.get("preprocess_cfg", {}) if "model_cfg" in data else {}
    return Architecture(name, config, preprocess if isinstance(preprocess, dict) else {}, False)


def pretrained_config(name: str, tag: str) -> dict:
    """open_clip's config of `name`'s pretrained `tag` (where its file is, its preprocessing)."""
    open_clip = import_open_clip(PREFIX + name)
    known = architecture(name)
    if not known.known:
        raise UsageError(
            f"`weights` {tag}: no such file; a model config file's architecture has no pretrained tags, give its "
            f"weights file"
        )
    config = open_clip.get_pretrained_cfg(name, tag)
    if not config:
        tags = open_clip.list_pretrained_tags_by_model(name)
        raise UsageError(
            f"`weights` {tag}: no such file, nor a pretrained tag of open_clip's {name}{did_you_mean(tag, tags)}"
            + (f"; its tags: {listing(tags, 8)}" if tags else "; open_clip publishes no weights for it")
        )
    if bool(config.get("quick_gelu")) != bool(known.config.get("quick_gelu")):
        # open_clip only warns, and the activations would not be those the weights were trained with
        fixed = f"{name}-quickgelu" if config.get("quick_gelu") else name.removesuffix("-quickgelu")
        raise UsageError(
            f"`weights` {tag} of {name} were trained with{'' if config.get('quick_gelu') else 'out'} QuickGELU, "
            f"and {name} has {'none' if config.get('quick_gelu') else 'it'}; give `model` {PREFIX}{fixed}"
        )
    return config


def cached_weights(name: str, tag: str) -> CachedWeights:
    """The cached file of open_clip's pretrained NAME/TAG: in the Hugging Face hub cache (the
    safetensors file preferred, as open_clip does), else open_clip's own cache of a URL's file."""
    config = pretrained_config(name, tag)
    fetch = f"python -c \"import open_clip; open_clip.create_model('{name}', pretrained='{tag}')\""  # noqa: B907
    if config.get("hf_hub"):
        from huggingface_hub import constants, try_to_load_from_cache

        repo, file = os.path.split(config["hf_hub"])  # 'org/name/' (open_clip's default file) or 'org/name/FILE'
        files = _hub_files(file)
        for candidate in files:
            found = try_to_load_from_cache(repo, candidate, cache_dir=constants.HF_HUB_CACHE)
            if isinstance(found, str):
                return CachedWeights(tag, Path(found), checked_blob(Path(found), tag))
    url_file = _url_file(config)
    if url_file is not None and (url_file.is_file() or not config.get("hf_hub")):
        return CachedWeights(tag, url_file, checked_file(url_file, tag, f"open_clip's cache {url_file.parent}", fetch))
    if config.get("hf_hub"):
        folder = Path(constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}"
        raise InputError(
            f"`weights` {tag}: open_clip's {repo} ({' or '.join(files)}) is not in the Hugging Face hub cache "
            f"{constants.HF_HUB_CACHE} (looked in {folder}); cafa downloads nothing: fetch it where there is a "
            f"network ({fetch}) and copy that folder there, or set HF_HUB_CACHE"
        )
    raise UsageError(f"`weights` {tag}: open_clip publishes no file for {name}/{tag}; give a weights file")


def _hub_files(file: str) -> list[str]:
    """The files open_clip looks for in a hub repository, in its order: the safetensors first."""
    from open_clip.constants import HF_SAFE_WEIGHTS_NAME, HF_WEIGHTS_NAME

    file = file or HF_WEIGHTS_NAME
    if file == HF_WEIGHTS_NAME:
        return [HF_SAFE_WEIGHTS_NAME, file]
    return [file[:-4] + ".safetensors", file] if file.endswith((".bin", ".pth")) else [file]


def _url_file(config: dict) -> Path | None:
    """Where open_clip keeps a URL's file (its default cache, ~/.cache/clip)."""
    url = config.get("url")
    return Path(os.path.expanduser("~/.cache/clip")) / os.path.basename(url) if url else None


def weights_file(path: str) -> CachedWeights:
    """A weights file, as cached weights are given to the builder (the name is its path)."""
    return CachedWeights(str(Path(path).resolve()), Path(path), sha256_of(path))


def build(name: str, kwargs: dict, weights: CachedWeights | None, prompting: Prompting | None) -> ZeroShotClassifier:
    """The zero-shot classifier of open_clip's `name` (with `kwargs` over its config, as
    create_model's model keywords) for the classes `prompting` names, its weights read by
    cafa's safe reader."""
    open_clip = import_open_clip(PREFIX + name)
    known = architecture(name)
    if prompting is None or not prompting.class_names:
        raise UsageError(
            f"`model` {PREFIX}{name} is a CLIP model, which classifies among the classes it is told the names of; "
            f"give them with `classes` FILE (one name a line, in output order)"
        )
    config = {**deepcopy(known.config), **kwargs}
    custom_text = bool(config.pop("custom_text", False)) or "hf_model_name" in config["text_cfg"]
    # no tower's pretrained weights: they would be downloaded, and the checkpoint replaces them
    if "timm_model_name" in config["vision_cfg"]:
        config["vision_cfg"]["timm_model_pretrained"] = False
    if "hf_model_name" in config["text_cfg"]:
        config["text_cfg"]["hf_model_pretrained"] = False
    if custom_text:
        kind = open_clip.CoCa if "multimodal_cfg" in config else open_clip.CustomTextCLIP
    else:
        kind = open_clip.CLIP
    model = built(PREFIX + name, lambda: kind(**config))
    if weights is not None:
        state = read_state_dict(weights.path)
        # load_checkpoint reads the file through this function (torch.load): it gets the state read above
        with mock.patch("open_clip.factory.load_state_dict", lambda *args, **options: dict(state)):
            built(PREFIX + name, lambda: open_clip.load_checkpoint(model, str(weights.path), strict=True))
    model.eval()
    tokenizer = built(PREFIX + name, lambda: _tokenizer(open_clip, known, config))
    return zero_shot_classifier(model, prompting.texts(model, tokenizer))


def _tokenizer(open_clip, known: Architecture, config: dict):
    """open_clip's tokenizer of the architecture (its get_tokenizer for its own; for a config
    file, what get_tokenizer picks from a text_cfg)."""
    if known.known:
        return open_clip.get_tokenizer(known.name)
    text = config["text_cfg"]
    context = text.get("context_length", 77)
    if text.get("hf_tokenizer_name"):
        return open_clip.HFTokenizer(text["hf_tokenizer_name"], context_length=context)
    return open_clip.SimpleTokenizer(context_length=context, **text.get("tokenizer_kwargs", {}))


def preprocessing(name: str, tag: str | None, kwargs: dict) -> dict:
    """The preprocessing open_clip's eval transform applies: the config's image size (resize the
    shorter side to it, centre crop it), the pretrained tag's (or config file's) mean, std and
    interpolation over open_clip's defaults (OpenAI's mean and std, bicubic)."""
    from open_clip.transform import PreprocessCfg, merge_preprocess_dict

    known = architecture(name)
    declared = merge_preprocess_dict(PreprocessCfg(), known.preprocess)
    if tag is not None:
        declared = merge_preprocess_dict(declared, pretrained_config(name, tag))
    size = {**known.config["vision_cfg"], **kwargs.get("vision_cfg", {})}.get("image_size", declared["size"])
    size = int(size[0] if isinstance(size, (tuple, list)) else size)
    interpolation = declared["interpolation"]
    return {
        "resize": size,
        "crop": size,
        "mean": tuple(float(v) for v in declared["mean"]),
        "std": tuple(float(v) for v in declared["std"]),
        "channels": 3,
        "interpolation": interpolation if interpolation in INTERPOLATIONS else "bicubic",
    }
