"""The protocol a test-time adaptation method follows.

The Adapter (adapter.py) runs every method the same way. Once, when it is built:
`method.check(model, device)`, then the parameters to train, `method.parameters(model,
which)`. For each test batch:

    method.before_step(images)
    logits, features = model(images)          # the prediction reported for the batch
    loss = method.loss(logits, features)      # then one optimiser step on those parameters
                                              # (`steps` times: forward, loss, step)
    logits = method.output(logits, features)  # the prediction reported (T3A, LAME change it)
    method.after_step(logits)

and `method.reset()` whenever the model goes back to the source weights. A method whose
reported predictions come from another network than the one adapted (a teacher) returns it
from `reporting_network(adapter)`, which `Adapter.features` reads the features of. Four hooks let
a method do more than a loss and a plain step (each defaults to doing nothing new):

- `output(logits, features)`: the logits reported for the batch, from the forward pass's
  (detached) logits and features: T3A's prototype classifier, LAME's Laplacian-adjusted
  assignment (returned as log-probabilities). The default returns `logits` unchanged.
- `leave_out`: a device bool scalar that `loss` may set, True where this batch's step
  must be left out (EATA when its filters kept no sample): the optimiser state then stays
  as it was, as for a non-finite loss, but the step is not counted as skipped. Sample
  weighting and filtering themselves belong in `loss` (masks and weights on the device).
- `id_score(logits)`: each image's in-distribution score (higher: in-distribution) from the
  logits reported, which the records and the AUROC of a stream with `outliers` use. The
  default is the maximum softmax probability; a method with a score of its own (STAMP's)
  returns it, from the logits or from what its last step kept.
- `owns_update = True` with `update(adapter, images, skipped) -> (logits, features, flag)`:
  the method runs its own forward passes and steps (SAR's two-pass SAM step and recovery,
  CoTTA's teacher and student), once for each of the Adapter's `steps`, through the
  Adapter's surface for such methods, `AdapterSurface` below, and nothing else of it
  (tests/test_tta_methods.py checks every method file). It returns the logits and
  features of the forward pass whose prediction is reported, and apply's flag. A method
  that trains nothing (`trains` False) may own its update too: update() then runs once a
  batch, calls no apply() and returns `skipped` as its flag (ttaug's augmented passes).

A method says what it changes with four class attributes:

- `needs_statistics`: it takes class Gaussians (`cafa stats`, or `estimate(moments)`) and is
  refused without them;
- `adapts_normalisation`: BatchNorms normalise with the test batch's statistics (False:
  they keep the source running statistics);
- `trains`: it has a loss and an optimiser (False: forward passes only, no gradients);
- `running_norms`: the Adapter's `norm` may keep statistics from batch to batch (ema:M,
  class-balanced, unmix:K) in its BatchNorms; where it may not, the reason, in words
  (CoTTA: "its teacher and anchor are copies of the model, BatchNorms included").

A method whose step is device work alone sets `capturable`: the tensors it keeps change in
place (`x += ...`, `x.copy_(...)`, never `self.x = new`), no Python value it keeps moves
from batch to batch, it reads nothing back to the host and draws no random numbers. On
CUDA the Adapter then captures its step as a CUDA graph and replays it (step_graph.py,
which checks the first two rules as it warms up; tests/test_step_graph.py checks them for
every method that says so). `per_batch` names the attributes a step makes and uses
within itself (`leave_out`), which are not state.

Every method is made the same way, a plug-in's too: `Method(gaussians=None, device="cpu",
**options)`. A method's own options (EATA's margins, LAME's affinity, ...) are `options`,
a tuple of options.Option: name, default, help and what it accepts. The base class checks
the keywords against it and sets each as an attribute of its name (the default where not
given), and each of `inputs` (data, not settings: eata's `fisher_batches`) as given or None;
then `setup()` makes what the method keeps from them. Recipes (recipes/*.toml) and
`--method-option NAME=VALUE` set options by name. The parameters it trains are chosen once,
when the Adapter is built: `choose_parameters(model, which)`, kept as `params`, after which
`attach(model)` makes what it keeps of the model (a teacher, the source values, layers of
its own). A method whose filter keeps some samples for its update sets `filters_samples`
and counts them in `kept`, a device scalar the Adapter reads once a domain.

What the rest of the tool must know of a method is a class attribute, read before it is
made: `needs_statistics`, `draws_random_numbers`, `capturable`, `predicts_before_update`,
`without_source_images`, `takes_labels`, `needs_clip`, `needs_tokens` (tests/test_registry.py observes each
of them).
A new method is a subclass in its own file, its recipe (recipes/NAME.toml) and one
entry in methods/__init__.py's REGISTRY (or an object given to the Adapter: the
registry is only for names).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

import torch
from torch import nn

from cafa_cli.core.devices import pick_device
from cafa_cli.core.errors import UsageError
from cafa_cli.engine.norms import NORM_LAYERS, BatchStatisticsNorm
from cafa_cli.engine.options import Option, resolve_options
from cafa_cli.engine.state import kind_of, refused, restore, restore_attributes, snapshot, tensors_sha256
from cafa_cli.model.features import FeatureClassifier
from cafa_cli.statistics.gaussians import ClassGaussians

STEP_HOOKS = ("loss", "update", "output", "before_step", "after_step")  # what a step runs of a method


class AdapterSurface(Protocol):
    """What a method that owns its update (`owns_update`) may use of the Adapter: these
    members, read-only except for the optimiser's state and the weights that a restore
    puts back. The Adapter (adapter.py) is the one implementation."""

    model: FeatureClassifier  # the adapted model (its state_dict, to restore parts of it)
    forward: nn.Module  # the model to call for logits and features (compiled with `compile`)
    autocast: AbstractContextManager  # the precision's autocast: wrap every forward pass in it
    steps: int  # optimiser steps a batch (a method with its own schedule counts them)
    optimizer: torch.optim.Optimizer  # whose state a restore resets
    source_state: dict[str, torch.Tensor]  # the model's state_dict at the source weights
    scaler: torch.amp.GradScaler | None  # fp16's loss scaler (None otherwise), for extra gradients

    def apply(
        self,
        loss: torch.Tensor,
        skipped: torch.Tensor | None = None,
        *,
        leave_out: torch.Tensor | None = None,
        after_backward=None,
    ) -> torch.Tensor:
        """One optimiser step on `loss`, left out on the device when it or a gradient is not
        finite (or `skipped`, or `leave_out`); `after_backward()` runs between the backward
        pass and the step. Returns the step's flag, float [1]: 1 where it was left out."""


class Method:
    """A test-time adaptation method: subclass it, set the class attributes, write `loss`."""

    name: str = ""
    needs_statistics: bool = False
    # its prediction for a batch is the plain forward pass before the batch's update, so on a
    # stream of one batch it predicts exactly as bn (t3a, lame, cotta and rotta change the
    # prediction itself: prototypes, Laplacian assignment, a teacher, robust normalisation)
    predicts_before_update: bool = False
    # it takes clean source images (one of its `inputs`: eata's `fisher_batches`); without them
    # it runs as this says (a warning); None: it takes none
    without_source_images: str | None = None
    adapts_normalisation: bool = True
    trains: bool = True
    running_norms: bool | str = True  # True, or why not
    gaussians: ClassGaussians | None = None  # the class statistics, for those that need them
    # where it keeps what it makes of its statistics (the Adapter's); what it makes of the model
    # is made where the model is. None: it was made without the base class's constructor
    device: torch.device | None = None
    # a count on the device of batches whose loss was computed less exactly than usual (cafa:
    # distances.refine_capacity), read by the Adapter once a domain; None: never
    unrefined: torch.Tensor | None = None
    owns_update: bool = False  # True: update() replaces the Adapter's forward, loss and step
    # why its predictions are not its network's, so that no exported network predicts as it does
    # (memo's update for each image, ttaug's augmented views); None: its network's (serving.py)
    not_served: str | None = None
    leave_out: torch.Tensor | None = None  # set by loss(): True leaves this batch's step out
    options: tuple[Option, ...] = ()  # its own options, set by keyword in the constructor
    inputs: tuple[str, ...] = ()  # constructor keywords that carry data, not settings (eata's fisher_batches)
    params: list[nn.Parameter]  # the model's parameters it trains (choose_parameters), kept once chosen
    filters_samples: bool = False  # True: `kept` counts the samples its filter kept, on the device
    kept: torch.Tensor | None = None
    # when its update is undefined (roid's and cmf's sample weights, min-max normalised over the
    # batch: one image, or images it scores alike); such a batch's step is left out and counted
    # in `undefined`, on the device. "": its update is defined for every batch
    undefined_when: str = ""
    undefined: torch.Tensor | None = None
    # a method with a change detector (cafa-robust) counts the changes of domain it saw since it
    # was made, on the host (reset keeps the count); None: it has none
    domain_changes: int | None = None
    source_restarts: int | None = None  # of those, the ones that put the source's weights back
    # CAFA-Oracle (`oracle`): a method whose loss uses the predicted class sets `takes_labels`
    # and reads it from `class_labels`; the stream then puts each batch's true labels (on the
    # device) in `oracle_labels` before its step, so that only the loss sees them
    takes_labels: bool = False
    oracle_labels: torch.Tensor | None = None
    capturable: bool = False  # its step may be replayed from a CUDA graph (module docstring)
    # it adapts a CLIP model's zero-shot classifier (model/clip.py: its text embeddings; TPT its text
    # tower) and refuses any other model: the CLIP test-time methods (methods/shared/zero_shot.py)
    needs_clip: bool = False
    # it inserts tokens into a vision transformer's token sequence (FOA's prompts, model/prompts.py) and
    # refuses a model without them, a CNN's in one line
    needs_tokens: bool = False
    # its steps draw from torch's generator (augmented views, masks, restores), so a domain's
    # predictions depend on the draws of the domains before it (torchrun keeps them in one process)
    draws_random_numbers: bool = False
    per_batch: tuple[str, ...] = ("leave_out", "oracle_labels")  # made and used within a step: not state
    # made once from what it was given and never changed by a step: not saved with its state
    unsaved: tuple[str, ...] = ("gaussians", "device", "params")  # params: the Adapter saves the weights
    # of those, the data a saved state must have been made with: recorded by its sha256 and
    # compared when the state is loaded (Adapter.load_state_dict), never taken from the file
    fingerprinted: tuple[str, ...] = ("gaussians",)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # `takes_labels` speaks for the loss written beside it: a subclass with a loss of its own
        # that does not say so again takes none (cafa-eata's loss finds its classes itself), so
        # that `oracle` is refused rather than silently changing nothing
        if "loss" in vars(cls) and "takes_labels" not in vars(cls):
            cls.takes_labels = False
        # and `capturable` for the step written beside it: a subclass that changes what a step
        # does is replayed only once it says so again (its state checked to change in place)
        if any(hook in vars(cls) for hook in STEP_HOOKS) and "capturable" not in vars(cls):
            cls.capturable = False

    @classmethod
    def on_any_classifier(cls) -> bool:
        """Whether it adapts any classifier: neither a CLIP method (`needs_clip`) nor one that
        needs a vision transformer's tokens (`needs_tokens`)."""
        return not (cls.needs_clip or cls.needs_tokens)

    def class_labels(self, logits: torch.Tensor) -> torch.Tensor:
        """The class of each sample that the loss aligns it with: the model's prediction (no
        gradient), or the true label under `oracle`."""
        return logits.detach().argmax(1) if self.oracle_labels is None else self.oracle_labels

    def __init__(self, gaussians: ClassGaussians | None = None, device: torch.device | str = "cpu", **options):
        """The class statistics (kept by a method that `needs_statistics`, which is refused
        without them; ignored by the others), the device it keeps what it makes of them on (the
        Adapter's), and its `options` and `inputs` by keyword (module docstring); then setup()."""
        name = self.name or type(self).__name__
        if self.needs_statistics and hasattr(gaussians, "gaussians"):  # an Artifact where its statistics go
            raise UsageError(
                f"the method {name} takes the artifact's class statistics: create({name!r}, artifact.gaussians)"
            )
        if self.needs_statistics and gaussians is None:
            raise UsageError(
                f"the method {name} needs class statistics: give it the gaussians of an artifact made by "
                f"cafa stats (read_artifact(path).gaussians), or estimate(moments) of the source features"
            )
        if self.needs_statistics:  # the others ignore them
            self.gaussians = gaussians
        self.device = resolve_device(device)
        inputs = {key: options.pop(key, None) for key in self.inputs}
        for key, value in {**resolve_options(name, self.options, options), **inputs}.items():
            setattr(self, key, value)
        self.params = []
        self.setup()

    def setup(self) -> None:
        """Make what it keeps from its statistics, options and inputs (called once they are set)."""

    def count_kept(self, kept: torch.Tensor) -> None:
        """Add a batch's kept-sample count (a device scalar) to `kept`, without a host sync."""
        if self.kept is None:
            self.kept = kept.detach().to(torch.int64, copy=True)
        else:  # in place, so that a replayed step (step_graph.py) counts too
            self.kept += kept.detach()

    def count_undefined(self, undefined: torch.Tensor) -> None:
        """Add a batch whose update is undefined (a device bool) to `undefined`, without a host sync."""
        if self.undefined is None:
            self.undefined = undefined.detach().to(torch.int64, copy=True).reshape(())
        else:
            self.undefined += undefined.detach().reshape(())

    def loss(self, logits: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The scalar to minimise for one batch, from the logits [N, C] and the features
        [N, d] entering the classifier (float32, both carrying gradients)."""
        raise NotImplementedError(f"{type(self).__name__} trains, so it needs a loss")

    def parameters(self, model: FeatureClassifier, which: str = "norm") -> list[nn.Parameter]:
        """What the optimiser trains, all others frozen (the Adapter asks once, the model on its
        device and normalising as it adapts): the parameters choose_parameters() picks, kept as
        `params`, once attach() has made what the method keeps of the model. A method that
        trains modules of its own (a projector) adds their parameters to these."""
        self.params = self.choose_parameters(model, which)
        self.attach(model)
        return self.params

    def choose_parameters(self, model: FeatureClassifier, which: str = "norm") -> list[nn.Parameter]:
        """The model's parameters it trains: `which` is `norm` or `all` (select_parameters)."""
        return select_parameters(model, which)

    def attach(self, model: FeatureClassifier) -> None:
        """Make what it keeps of the model, its `params` chosen (a teacher, their source
        values, layers of its own): called once, before the Adapter records the source state."""

    def check(self, model: FeatureClassifier, device: torch.device) -> None:
        """Raise UsageError when it cannot adapt `model` on `device`: statistics of another
        shape, or kept on another kind of device. Called before the Adapter changes anything."""
        if self.gaussians is not None and tuple(self.gaussians.means.shape) != (model.num_classes, model.feature_dim):
            C, d = self.gaussians.means.shape
            raise UsageError(
                f"the statistics are for {C} classes of {d}-dimensional features but the model has {model.num_classes} "
                f"outputs and {model.feature_dim}-dimensional features; compute them with this model"
            )
        if self.gaussians is not None and self.device.type != device.type:
            raise UsageError(
                f"the method {self.name} keeps its statistics on {self.device} but adapts on {device}; "
                f"create it with device={str(device)!r}"
            )

    def output(self, logits: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The logits reported for the batch, from the forward pass's logits [N, C] and
        features [N, d] (float32, detached, under no_grad). Default: the logits as they are."""
        return logits

    def id_score(self, logits: torch.Tensor) -> torch.Tensor:
        """Each image's in-distribution score [N] from the batch's reported logits [N, C] (after
        `output`), higher for an image of the label set: what tells outliers apart (`outliers`).
        Default: the maximum softmax probability, the confidence of the reported prediction."""
        return logits.softmax(1).amax(1)

    def update(self, adapter: AdapterSurface, images: torch.Tensor, skipped: torch.Tensor | None):
        """For a method with `owns_update`: one update on `images` through the Adapter's
        forward and apply(); returns (logits, features, apply's flag)."""
        raise NotImplementedError(f"{type(self).__name__} sets owns_update, so it needs update()")

    def reporting_network(self, adapter: AdapterSurface) -> nn.Module:
        """The network whose features a step reports with its prediction: the adapted model
        (`adapter.forward`); a teacher-student method's teacher."""
        return adapter.forward

    def served_network(self, adapter: AdapterSurface) -> FeatureClassifier:
        """The network that serves its predictions once the stream is over (Adapter.export):
        the adapted model; a teacher-student method's teacher."""
        return adapter.model

    def before_step(self, images: torch.Tensor) -> None:
        """Called with each batch (on the Adapter's device) before its forward pass."""

    def after_step(self, logits: torch.Tensor) -> None:
        """Called with each batch's reported logits, after its update."""

    def reset(self) -> None:
        """Called when the model goes back to the source weights: drop any state kept."""

    def state_dict(self) -> dict:
        """What the method carries from batch to batch, as plain data (engine/state.py): every
        attribute but its options (settings: Adapter.state_dict records and checks them), those
        made once from its inputs (`unsaved`), its inputs and per-batch values. The Adapter saves
        it with the weights and the optimiser (Adapter.state_dict)."""
        left_out = self.not_state()
        return {key: snapshot(value) for key, value in vars(self).items() if key not in left_out}

    def load_state_dict(self, state: dict) -> None:
        """A state_dict() of this method, put back (in place where the tensors already are).
        Only into what this method keeps (engine/state.py): an entry it has no place for, or
        of another kind, is an InputError and the caller's to undo (Adapter.load_state_dict)."""
        if not isinstance(state, dict):
            raise refused("method_state", f"is {kind_of(state)}, not a method's attributes")
        if "params" in state:  # states saved before issue 61 held the weights here too: checked, then the Adapter's
            state = dict(state)
            restore([p.detach().clone() for p in self.params], state.pop("params"), "method_state.params")
        restore_attributes(self, state, "method_state", self.not_state())

    def not_state(self) -> frozenset[str]:
        """Attributes that are no part of its saved state: its options, and what `unsaved`,
        `inputs` and `per_batch` name."""
        options = (option.name for option in type(self).options)
        return frozenset((*self.unsaved, *self.fingerprinted, *self.inputs, *self.per_batch, *options))

    def fingerprints(self) -> dict[str, str]:
        """The sha256 of each `fingerprinted` piece of data it was made from (its class
        statistics, EATA's Fisher; "none" where it has none), and whether each of its `inputs`
        was given: what a saved state must have been made with, besides the settings."""
        made = {
            key: "none" if getattr(self, key, None) is None else tensors_sha256(getattr(self, key))
            for key in self.fingerprinted
        }
        given = {key: "given" if getattr(self, key, None) is not None else "none" for key in self.inputs}
        return {**made, **given}


def resolve_device(device: torch.device | str) -> torch.device:
    """`auto` and CUDA checked to be there (pick_device); a torch.device of another kind
    (mps, xla, meta) is the caller's choice."""
    return (
        pick_device(device) if isinstance(device, str) or torch.device(device).type == "cuda" else torch.device(device)
    )


def select_parameters(
    model: FeatureClassifier, which: str = "norm", frozen: tuple[str, ...] = ()
) -> list[nn.Parameter]:
    """Freeze everything, then unfreeze the normalisation affines (`norm`) or the
    whole feature extractor (`all`, the paper's CAFA-Full). The classifier stays fixed,
    and so do the modules that `frozen` names (in_frozen)."""
    model.requires_grad_(False)
    held = {id(p) for name, module in model.named_modules() if in_frozen(name, frozen) for p in module.parameters()}
    if which == "all":
        classifier = {id(p) for p in model.classifier.parameters()}
        chosen = [p for p in model.parameters() if id(p) not in classifier]
    else:
        chosen = []
        for module in model.modules():
            if isinstance(module, (BatchStatisticsNorm, *NORM_LAYERS)):
                chosen += [p for p in (module.weight, module.bias) if isinstance(p, nn.Parameter)]
    unique = [p for p in {id(p): p for p in chosen}.values() if id(p) not in held]
    if not unique:
        what = "normalisation layers with affine parameters" if which == "norm" else "parameters before its classifier"
        raise UsageError(f"the model has no {what} to adapt; use `params` all, or `method` source or bn")
    for p in unique:
        p.requires_grad_(True)
    return unique


def with_classifier(model: FeatureClassifier, which: str = "norm", every: bool = False) -> list[nn.Parameter]:
    """`all`: the classifier's parameters too, and of the rest those a module holds as
    `weight` or `bias`, as the benchmark collection's TTAMethod.collect_params takes them for
    CoTTA, RMT and AdaContrast (and CoTTA's authors' collect_params), so that a ViT's pos_embed
    and cls_token stay frozen as there; `every`: every parameter (MEMO's authors' optimiser
    takes net.parameters()). Otherwise select_parameters' (the normalisation affines)."""
    if which != "all":
        return select_parameters(model, which)
    model.requires_grad_(every)
    if not every:
        for module in model.modules():
            for name, p in module.named_parameters(recurse=False):
                p.requires_grad_(name in ("weight", "bias"))
    return [p for p in model.parameters() if p.requires_grad]


def check_module_names(model: nn.Module, names: tuple[str, ...], option: str) -> None:
    """Each of `names` a user gave holds some module of the model (in_frozen's rule): a typo
    (`layr2`) would otherwise leave the model as it is, silently."""
    modules = [name for name, _ in model.named_modules() if name not in ("", "model")]  # not the wrapper
    unmatched = [name for name in names if not any(in_frozen(module, (name,)) for module in modules)]
    if unmatched:
        top = list(dict.fromkeys(module.split(".")[1 if module.startswith("model.") else 0] for module in modules))
        raise UsageError(
            f"{option}: {', '.join(unmatched)} names no module of the model (whole dotted components, e.g. layer4 "
            f"or blocks.9; its top-level modules: {', '.join(top[:20])})"
        )


def in_frozen(module_name: str, frozen: tuple[str, ...]) -> bool:
    """Whether a module lies in one that `frozen` names: a name matches whole dotted
    components anywhere in the module's (`layer4` holds `model.layer4.0.bn1`; `blocks.9`
    holds `blocks.9.norm1`, not `blocks.90`), so that the same names find a torchvision
    ResNet's top stage inside any wrapper; on ResNets and ViTs this is what SAR's official
    code does by substring (`'layer4' in name`). `norm` is the authors' own rule for a ViT's
    final norm: the model's top-level module `norm`, or a name holding `norm.`; so ConvNeXt's
    `stages.1.blocks.0.norm` and `head.norm` adapt, as they do in the authors' code."""
    padded = f".{module_name}."
    bare = module_name.removeprefix("model.")  # FeatureClassifier's attribute; the authors name the bare model's
    return any(
        (bare == "norm" or "norm." in module_name) if name == "norm" else f".{name}." in padded for name in frozen
    )
