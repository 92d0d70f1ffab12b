"""CLIP-style dual encoders as classifiers. The image encoder, then the zero-shot head: the
classes' text embeddings, scaled by the model's temperature, as the weight of an nn.Linear.
So the features every method sees (FeatureClassifier's, `cafa stats`') are the unit-norm image
embeddings entering that layer, and every method that adapts a classifier runs on a CLIP
model unchanged, with the text head fixed.

The text tower stays outside the module tree (`ZeroShotClassifier.text`): the methods that
adapt normalisation layers must find the image encoder's alone, and the weights' fingerprint
is that of the classifier the methods adapt. The CLIP methods that tune prompts (TPT) reach
it through `text`.

How the classes are put into words (`Prompting`): their names (an ImageNet wnid prompts with
CLIP's own cleaned name of its class, data/imagenet_classes.tsv, the CLIP repository's
notebook list) and the templates, `single`, `imagenet80` (the CLIP paper's 80, in
clip_data/imagenet80.txt) or a file."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from cafa_cli.core.errors import InputError, UsageError, did_you_mean, listing
from cafa_cli.core.files import absolute, read_small_text
from cafa_cli.data.benchmarks import imagenet_classes

CLIP_DATA = Path(__file__).with_name("clip_data")
TEMPLATE_SETS = ("single", "imagenet80")
SINGLE_TEMPLATE = "a photo of a {}."
PROMPT_BATCH = 256  # prompts through the text tower at once
TEMPLATES_LIMIT = 64 << 20  # CuPL's ImageNet descriptions are 5 MB; a file over this is no such list


@dataclass(frozen=True)
class ClassTexts:
    """What names the classes: the dual encoder (its text tower), its tokenizer, the class
    names and the prompt templates ('a photo of a {}.'), or per class its own prompts
    (CuPL-style descriptions) in `prompts`."""

    model: nn.Module  # an open_clip CLIP: encode_text, token_embedding, transformer, ln_final, text_projection
    tokenizer: object  # open_clip's: list of str -> LongTensor [n, context_length]
    class_names: tuple[str, ...]
    templates: tuple[str, ...] = ("a photo of a {}.",)
    prompts: tuple[tuple[str, ...], ...] | None = None  # per class, replaces the templates where given

    def class_prompts(self, index: int) -> tuple[str, ...]:
        if self.prompts is not None and self.prompts[index]:
            return self.prompts[index]
        return tuple(template.format(self.class_names[index]) for template in self.templates)


OPENCLIP_MISSING = "needs open_clip, which is not installed: pip install 'cafa-cli[clip]'"


def import_open_clip(model: str):
    """open_clip, or one line naming the extra that installs it (`model`: the model that needs it)."""
    try:
        import open_clip
    except ImportError:
        raise UsageError(f"`model` {model} {OPENCLIP_MISSING}") from None
    return open_clip


@torch.no_grad()
def class_embeddings(texts: ClassTexts, device: torch.device | str = "cpu") -> torch.Tensor:
    """[classes, dim] unit-norm: per class, the mean of its prompts' unit-norm text embeddings,
    normalised again (the CLIP paper's prompt ensemble)."""
    prompts = [texts.class_prompts(index) for index in range(len(texts.class_names))]
    flat = [prompt for own in prompts for prompt in own]
    # the text tower runs on batches of prompts, not a class at a time: ImageNet's 1,000
    # classes x 80 templates are 80,000 prompts
    embedded = torch.cat(
        [
            F.normalize(
                texts.model.encode_text(texts.tokenizer(flat[start : start + PROMPT_BATCH]).to(device)).float(), dim=-1
            )
            for start in range(0, len(flat), PROMPT_BATCH)
        ]
    )
    means = [part.mean(0) for part in embedded.split([len(own) for own in prompts])]
    return F.normalize(torch.stack(means), dim=-1)


class ZeroShotClassifier(nn.Module):
    """logits = logit_scale · normalize(image_encoder(x)) · class_embedding; the head is an
    nn.Linear without bias whose rows are logit_scale · class embedding (unit-norm), so
    `head.weight.norm(dim=1)` is the temperature and its direction the text embedding. The
    weight is a buffer, so the text head stays fixed whatever a method trains."""

    def __init__(
        self,
        image_encoder: nn.Module,
        class_embedding: torch.Tensor,
        logit_scale: float,
        texts: ClassTexts | None = None,
    ):
        super().__init__()
        classes, dim = class_embedding.shape
        self.image_encoder = image_encoder
        self.head = nn.Linear(dim, classes, bias=False)
        # a buffer, not a parameter: no method's choice of parameters (`params` all trains a
        # classifier with the rest) can train the text head; the state dict is the same
        del self.head.weight
        self.head.register_buffer("weight", float(logit_scale) * F.normalize(class_embedding.float().detach(), dim=-1))
        self.text = texts  # a plain attribute, not a submodule (see the module's docstring)

    @property
    def logit_scale(self) -> float:
        return float(self.head.weight.norm(dim=1).mean())

    @property
    def class_names(self) -> Sequence[str] | None:
        return None if self.text is None else self.text.class_names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.normalize(self.image_encoder(x), dim=-1))


def zero_shot_classifier(clip_model: nn.Module, texts: ClassTexts) -> ZeroShotClassifier:
    """The zero-shot classifier of an open_clip CLIP model for the classes `texts` names;
    the image encoder is the model's own `visual` module (shared, not copied)."""
    device = next(clip_model.parameters()).device
    return ZeroShotClassifier(
        clip_model.visual, class_embeddings(texts, device), float(clip_model.logit_scale.detach().exp()), texts
    )


class PromptedTexts(nn.Module):
    """The class embeddings of CoOp's prompts, [SOS] + context + class name + "." + [EOS],
    whose context token embeddings `ctx` [n, width] are learnable (TPT's PromptLearner and
    TextEncoder, azshue/TPT clip/custom_clip.py): open_clip's text transformer run on token
    embeddings rather than tokens. `ctx` starts as the embeddings of `context`'s tokens, so
    that, untrained, the embeddings are class_embeddings' of the one template "`context` {}.".
    The text tower's modules are shared with `texts.model`, not copied (moving this module
    moves them), and only `ctx` takes gradients. Needs open_clip's own text tower
    (`open_clip.CLIP`: token_embedding, transformer, ln_final, text_projection)."""

    def __init__(self, texts: ClassTexts, context: str = "a photo of a"):
        super().__init__()
        model = texts.model
        missing = [
            a for a in ("token_embedding", "positional_embedding", "transformer", "ln_final") if not hasattr(model, a)
        ]
        if missing:
            raise UsageError(
                f"prompt tuning runs open_clip's own text transformer, which this dual encoder "
                f"({type(model).__name__}) has not ({', '.join(missing)} missing); use an open_clip CLIP model"
            )
        device = model.positional_embedding.device
        count = int((texts.tokenizer([context])[0] != 0).sum()) - 2  # its tokens, less [SOS] and [EOS]
        tokens = texts.tokenizer([f"{context} {name}." for name in texts.class_names]).to(device)
        with torch.no_grad():
            context_tokens = texts.tokenizer([context]).to(device)
            ctx = model.token_embedding(context_tokens)[0, 1 : 1 + count].clone()
            embedded = model.token_embedding(tokens)
        self.transformer, self.ln_final = model.transformer, model.ln_final
        self.positional_embedding, self.text_projection = model.positional_embedding, model.text_projection
        self.register_buffer("attn_mask", getattr(model, "attn_mask", None), persistent=False)
        self.pool_type, self.eos_id = getattr(model, "text_pool_type", "argmax"), getattr(model, "text_eos_id", None)
        self.register_buffer("tokens", tokens, persistent=False)
        self.register_buffer("prefix", embedded[:, :1].clone(), persistent=False)  # [SOS]
        self.register_buffer("suffix", embedded[:, 1 + count :].clone(), persistent=False)  # name, ".", [EOS], padding
        self.register_buffer("ctx_init", ctx.clone(), persistent=False)
        self.requires_grad_(False)
        self.ctx = nn.Parameter(ctx)

    def reset(self) -> None:
        with torch.no_grad():
            self.ctx.copy_(self.ctx_init)

    def forward(self) -> torch.Tensor:
        """[classes, dim] unit-norm class embeddings of the prompts with the current context (the text
        tower's dtype)."""
        from open_clip.transformer import text_global_pool

        cast = self.transformer.get_cast_dtype()
        ctx = self.ctx.unsqueeze(0).expand(len(self.prefix), -1, -1)
        x = torch.cat([self.prefix, ctx, self.suffix], dim=1).to(cast)
        x = x + self.positional_embedding.to(cast)
        x = self.ln_final(self.transformer(x, attn_mask=self.attn_mask))
        x = text_global_pool(x, self.tokens, self.pool_type, eos_token_id=self.eos_id)
        if isinstance(self.text_projection, nn.Linear):
            x = self.text_projection(x)
        elif self.text_projection is not None:
            x = x @ self.text_projection
        return F.normalize(x, dim=-1)


def template_set(name: str) -> tuple[str, ...]:
    """The templates a set names: `single`, or `imagenet80`."""
    if name == "single":
        return (SINGLE_TEMPLATE,)
    return tuple((CLIP_DATA / f"{name}.txt").read_text(encoding="utf-8").splitlines())


def prompt_name(class_name: str) -> str:
    """The words a class is prompted with: CLIP's name of an ImageNet wnid, else the name itself
    (so that a class list of wnids, as cafa takes ImageNet's, names ImageNet's classes as CLIP does)."""
    return imagenet_classes().get(class_name, class_name)


@dataclass(frozen=True)
class Prompting:
    """How a CLIP model's classes are put into words: their names, in output order, and the
    `templates` option (a set's name or a file; None: single)."""

    class_names: tuple[str, ...]
    templates: str | None = None

    @property
    def recorded_templates(self) -> str:
        """As an artifact records it: a set's name, or the file's absolute path."""
        name = self.templates or "single"
        return name if name in TEMPLATE_SETS else absolute(name)

    def texts(self, model: nn.Module, tokenizer) -> ClassTexts:
        """The ClassTexts of `model`'s text tower for these classes."""
        names = tuple(prompt_name(name) for name in self.class_names)
        templates, described = self._read()
        if described is None:
            return ClassTexts(model, tokenizer, names, templates)
        return ClassTexts(model, tokenizer, names, templates, self._descriptions(described, names))

    def _read(self) -> tuple[tuple[str, ...], dict | None]:
        """(templates, CuPL descriptions by class name or None)."""
        name = self.templates or "single"
        if name in TEMPLATE_SETS:
            return template_set(name), None
        if not Path(name).exists():
            raise UsageError(
                f"`templates` {name}: no such file, nor a template set{did_you_mean(name, list(TEMPLATE_SETS))}; "
                f"give {' or '.join(TEMPLATE_SETS)}, or a file of templates"
            )
        fix = "give one template with {} a line, a JSON list of them, or CuPL's JSON {class name: [descriptions]}"
        text = read_small_text(name, "`templates`", TEMPLATES_LIMIT, fix)
        if name.lower().endswith(".json"):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as error:
                raise InputError(f"`templates` {name}: not JSON ({error.msg}, line {error.lineno}); {fix}") from None
            if isinstance(value, dict) and all(
                isinstance(v, list) and v and all(isinstance(d, str) and d.strip() for d in v) for v in value.values()
            ):
                return (SINGLE_TEMPLATE,), value
            if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
                raise InputError(f"`templates` {name}: neither a list of templates nor a dict of descriptions; {fix}")
            lines = value
        else:
            lines = text.splitlines()
        templates = tuple(line.strip() for line in lines if line.strip())
        broken = [t for t in templates if t.count("{}") != 1]
        if not templates or broken:
            what = f"{broken[0]!r} has {broken[0].count('{}')} {{}}" if broken else "no templates"
            raise InputError(f"`templates` {name}: {what}, where the class name goes once in each; {fix}")
        return templates, None

    def _descriptions(self, described: dict, names: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
        """Each class's descriptions, found by the name it is prompted with, else by its own."""
        found = [described.get(name, described.get(own)) for name, own in zip(names, self.class_names)]
        missing = [own for own, prompts in zip(self.class_names, found) if prompts is None]
        if missing:
            raise InputError(
                f"`templates` {self.templates}: no descriptions of {listing(missing)}; the file must describe every "
                f"class, by its name (or CLIP's name of an ImageNet wnid){did_you_mean(missing[0], list(described))}"
            )
        return tuple(tuple(prompts) for prompts in found)


def prompts_sha256(texts: ClassTexts) -> str:
    """A fingerprint of every class's prompts, in output order: the class names and the
    templates (or descriptions) the zero-shot head is made of."""
    prompts = [list(texts.class_prompts(i)) for i in range(len(texts.class_names))]
    return hashlib.sha256(json.dumps(prompts, ensure_ascii=False).encode()).hexdigest()
