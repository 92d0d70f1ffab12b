"""`cafa stats`'s settings: which training images, through which model, into which artifact."""

from __future__ import annotations

from dataclasses import dataclass

from cafa_cli import DEFAULT_ARTIFACT
from cafa_cli.core.errors import UsageError
from cafa_cli.data.values import check_batch_size
from cafa_cli.jobs.config.checks import check, check_covariance, check_seed
from cafa_cli.jobs.config.data import InputOptions, ModelOptions
from cafa_cli.jobs.config.settings import (
    AS_BUILT,
    DATA,
    MODEL,
    OUTPUT,
    OUTPUT_FILE,
    RUNTIME,
    STATISTICS,
    Covariance,
    RuntimeOptions,
    SamplingOptions,
    setting,
)

# why the run's JSON does not keep `max_error` (the exit code, 4, is cli/errors.EXIT_ABOVE_MAX_ERROR)


@dataclass(kw_only=True)
class StatsConfig(ModelOptions, InputOptions, SamplingOptions, RuntimeOptions):
    """`cafa stats`: per-class feature Gaussians of training images, into an artifact."""

    data: str | None = setting(
        None,
        "Training images: an ImageFolder, a .npy array (--labels), or cifar10:ROOT / cifar100:ROOT "
        "/ fashion-mnist:ROOT. Required, unless --from-text.",
        flags=("--data", "-d"),
        metavar="PATH",
        panel=DATA,
        brief=True,
        recorded="resolved: the domains as opened, each with its error",
    )
    model: str | None = setting(
        "resnet50",
        ModelOptions.__dataclass_fields__["model"].metadata["help"],
        flags=("--model", "-m"),
        metavar="NAME",
        panel=MODEL,
        brief=True,
        names_code=True,
        recorded=AS_BUILT,
    )
    seed: int = setting(0, "Seed of the stratified subset.", metavar="N", panel=STATISTICS)
    covariance: Covariance = setting(
        "auto",
        "auto (lowrank when every class has fewer images than feature dimensions, "
        "else full), full (per class), lowrank (exact, a·I + low rank per class), tied "
        "(one pooled), or diag.",
        panel=STATISTICS,
        brief=True,
        recorded="resolved: the form the artifact holds",
    )
    from_text: bool = setting(
        False,
        "No images: a CLIP model's class Gaussians from its text embeddings (each class's mean its unit "
        "text embedding, one isotropic covariance I/d), for CAFA where no source images exist.",
        panel=STATISTICS,
    )
    norm_moments: bool = setting(
        False,
        "Also record each class's mean and variance of every BatchNorm's input, which "
        "adapt --norm class-balanced needs (2·C·channels values a layer).",
        panel=STATISTICS,
    )
    batch_size: int = setting(
        128,
        "Images per batch: one forward pass each (memory and speed; the statistics are the same up to float64 "
        "rounding).",
        metavar="N",
        panel=RUNTIME,
    )
    out: str = setting(
        DEFAULT_ARTIFACT,
        "Artifact to write (atomically).",
        flags=("--out", "-o"),
        metavar="PATH",
        panel=OUTPUT,
        brief=True,
        recorded=OUTPUT_FILE,
    )

    def __post_init__(self):
        check(self)
        check_seed("seed", self.seed)
        check_batch_size(self.batch_size)
        check_covariance(self.covariance, self.shrinkage_value())

    def _check_statistics_source(self) -> None:
        if self.from_text and self.data is not None:
            raise UsageError("`from_text` and `data` are two sources of the statistics; give one of them")
        if self.from_text and self.class_subset:
            raise UsageError("`from_text` takes every class the model names; leave out `class_subset`")
        if not self.from_text and self.data is None:
            raise UsageError("`data` is missing: give the training images (or `from_text` for a CLIP model)")

    def outputs(self) -> dict[str, str | None]:
        return {"`out`": self.out}

    def inputs(self) -> dict[str, str | list[str] | None]:
        return {
            **self.model_inputs(),
            "`classes`": self.classes,
            "`class_subset`": self.class_subset,
            "`labels`": self.labels,
            "`data`": self.data,
        }
