"""Whether an artifact belongs to a model: the rules that compare what it records
(architecture, factory code, weights, parameter fingerprint) with the model given."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from cafa_cli.artifact.store import Artifact
from cafa_cli.core.errors import InputError
from cafa_cli.core.factories import is_factory
from cafa_cli.model.features import FeatureClassifier
from cafa_cli.model.loading import ModelSpec, bundled_model, factory_sha256, parameters_sha256


def recorded_model(artifact: Artifact, given):
    """The artifact's model, with what the user gave in its place.

    A factory (`file.py:fn`) named by an artifact would run code from a file the
    artifact merely points to: it runs only when the user names it with --model too
    (or passes --trust-checkpoint).
    """
    recorded = artifact.model
    if is_factory(recorded.model) and given.model is None and not given.trust_checkpoint:
        raise InputError(
            f"{artifact.path} names the model factory {recorded.model}, whose code would run; "
            f"pass `model` {recorded.model} to run it (or `trust_checkpoint`)"
        )
    weights = given.weights or recorded.weights
    # a file is recorded by its absolute path; pretrained weights by name are found in the cache
    if weights and given.weights is None and Path(weights).is_absolute() and not Path(weights).is_file():
        raise InputError(
            f"the artifact's weights {weights} are not there; pass `weights` FILE (the same file) "
            f"or `model`/`weights` to use another model"
        )
    num_classes = given.num_classes or recorded.num_classes
    return replace(
        given,
        model=recorded.model,
        weights=weights,
        num_classes=num_classes,
        classifier=given.classifier or recorded.classifier,
        model_args=given.model_args or [f"{key}={value}" for key, value in (recorded.model_args or {}).items()],
        templates=given.templates or recorded.templates,
    )


def model_mismatch(artifact: Artifact, spec: ModelSpec, net: FeatureClassifier) -> str | None:
    """Why the artifact does not hold statistics of this model with these parameters, or
    None when it does. They describe the features of one model with one set of weights:
    another architecture or other weights (a changed file, --weights, a retrained bundled
    model) would be aligned to the wrong Gaussians without any error. The same parameters
    re-saved or converted to another format are the same model (the artifact's parameter
    fingerprint recognises them), and so is a factory file copied elsewhere."""
    recorded = artifact.model
    same_code = artifact.factory_sha256 is not None and factory_sha256(spec.model) == artifact.factory_sha256
    same_function = recorded.model.rpartition(":")[2] == spec.model.rpartition(":")[2]
    if spec.model != recorded.model and not (
        same_code and same_function
    ):  # a factory file copied elsewhere is the same model
        # its code may compute other features from the same parameters
        return f"{artifact.path} holds statistics of the model {recorded.model}, not of {spec.model}"
    if (spec.model_args or {}) != (recorded.model_args or {}):
        # other constructor arguments build another network (image_size, depth, ...)
        return (
            f"{artifact.path} holds statistics of {recorded.model} with `model_arg` {_args(recorded.model_args)}, "
            f"not {_args(spec.model_args)}"
        )
    if spec.prompts_sha256 != recorded.prompts_sha256:
        # a CLIP model's text head: the same weights with other class names or templates are another classifier
        return (
            f"{artifact.path} holds statistics of {recorded.model} with the prompts of `templates` "
            f"{recorded.templates} for its class list, not with those of {spec.templates}"
        )
    if artifact.factory_sha256 is not None and not same_code:
        # the same parameters through edited code can give other features
        return (
            f"{spec.model.rpartition(':')[0]} has changed since the statistics in {artifact.path} were computed "
            f"(its sha256 differs)"
        )
    if spec.weights_sha256 is not None and spec.weights_sha256 == recorded.weights_sha256:
        return None  # the same file
    if parameters_sha256(net.model) == artifact.parameters_sha256:
        return None  # the same parameters from another file
    differ = "parameters differ"
    if spec.weights is None and recorded.weights is None:
        what = (
            f"the bundled {spec.model} weights have changed"
            if bundled_model(spec.model)
            else (f"{spec.model} initialised its parameters differently (it draws them at random? give `weights`)")
        )
        return f"{what} since the statistics in {artifact.path} were computed ({differ})"
    if spec.weights == recorded.weights:
        return f"{spec.weights} has changed since the statistics were computed ({differ})"
    own = "its packaged weights" if bundled_model(spec.model) else "the model's own initialisation (no `weights`)"
    made_with, given = recorded.weights or own, spec.weights or own
    return f"{artifact.path} holds statistics of {spec.model} with {made_with}, not with {given} ({differ})"


def _args(model_args: dict | None) -> str:
    return " ".join(f"{key}={value}" for key, value in (model_args or {}).items()) or "(none)"
