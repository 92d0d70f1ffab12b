"""`cafa plot features`' settings: one domain, the methods to compare, the figure."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cafa_cli import DEFAULT_ARTIFACT
from cafa_cli.core.errors import UsageError
from cafa_cli.jobs.config.checks import _axis, check, check_seed, factory_file
from cafa_cli.jobs.config.data import InputOptions, ModelOptions
from cafa_cli.jobs.config.settings import (
    DATA,
    METHOD,
    MODEL,
    OUTPUT,
    OUTPUT_FILE,
    STREAM,
    AdaptationOptions,
    MethodDataOptions,
    RecipeOptions,
    RuntimeOptions,
    StreamOptions,
    setting,
)
from cafa_cli.methods import REGISTRY, is_plugin

# why the run's JSON does not keep `max_error` (the exit code, 4, is cli/errors.EXIT_ABOVE_MAX_ERROR)


PLOT_FORMATS = (".png", ".svg")  # what `cafa plot features --out` writes, by its extension


@dataclass(kw_only=True)
class FeaturesPlotConfig(
    ModelOptions, InputOptions, AdaptationOptions, RecipeOptions, MethodDataOptions, StreamOptions, RuntimeOptions
):
    """`cafa plot features`: a 2-D embedding (t-SNE) of one domain's features before and after
    adaptation, one panel a method, each run as `cafa adapt` runs it."""

    data: list[str] = setting(
        help="The test domain: an ImageFolder (one folder per class colours the points by class), "
        "an unlabelled folder, or a .npy array.",
        factory=list,
        flags=("--data", "-d"),
        metavar="PATH",
        panel=DATA,
        brief=True,
        recorded="resolved: the domains as opened, each with its error",
    )
    stats: str | None = setting(
        None,
        f"Artifact from cafa stats (default: {DEFAULT_ARTIFACT}): it names the model, and its "
        f"class means are drawn among the features.",
        flags=("--stats", "-s"),
        metavar="PATH",
        panel=MODEL,
        brief=True,
        recorded="resolved: the artifact's absolute path, creation time and form",
    )
    allow_weights_mismatch: bool = setting(
        False,
        "Use the artifact with another model or other weights than it was computed with.",
        panel=MODEL,
        command_line_only=True,
    )
    methods: str = setting(
        "source,tent,cafa",
        "One panel per method, comma-separated, each adapted over the domain as cafa "
        "adapt --method would; source is the model before adaptation.",
        metavar="M,...",
        panel=METHOD,
        brief=True,
        names_code=True,
        recorded="resolved: the rows, each with its method and settings",
    )
    out: str = setting(
        "features.png",
        "The figure, PNG or SVG by its extension (written atomically).",
        flags=("--out", "-o"),
        metavar="FILE",
        panel=OUTPUT,
        brief=True,
        recorded=OUTPUT_FILE,
    )
    seed: int = setting(
        0,
        "Seed of the image sample, the stream order and the embedding: the same seed gives the same "
        "file, byte for byte.",
        metavar="N",
        panel=STREAM,
    )
    max_images: int | None = setting(
        1000,
        "Images of the domain to adapt on and embed, a stratified sample (t-SNE's time grows with them); 0: all.",
        metavar="N",
        panel=DATA,
    )
    perplexity: float = setting(
        30.0, "t-SNE's perplexity (at most a third of the images and class means).", metavar="P", panel=OUTPUT
    )
    json: bool = setting(
        False,
        "Print each panel's numbers (error, feature scatter, Mahalanobis distance) as JSON on stdout.",
        panel=OUTPUT,
        brief=True,
        recorded=OUTPUT_FILE,
    )

    def __post_init__(self):
        check(self)
        check_seed("seed", self.seed)
        if len(self.data) != 1:
            raise UsageError(f"cafa plot features embeds one domain, and {len(self.data)} are given; give one DOMAIN")
        if Path(self.out).suffix.lower() not in PLOT_FORMATS:
            raise UsageError(
                f"`out` {self.out}: the figure is written as PNG or SVG by its extension; give a name ending in "
                f"{' or '.join(PLOT_FORMATS)}"
            )
        if self.max_images is not None and self.max_images < 0:
            raise UsageError(f"`max_images` must be 0 (all) or more, not {self.max_images}")
        if not self.perplexity > 0:
            raise UsageError(f"`perplexity` must be a positive number, not {self.perplexity}")
        for method in self.method_list():
            if method not in REGISTRY and not is_plugin(method):
                raise UsageError(
                    f"`methods` names {method}, which is no method; give some of {', '.join(REGISTRY)} (or a "
                    f"plug-in module:factory)"
                )

    def method_list(self) -> list[str]:
        """The panels' methods, in order, each once."""
        return _axis(self.methods, "methods", "a method")

    def outputs(self) -> dict[str, str | None]:
        return {"`out`": self.out}

    def inputs(self) -> dict[str, str | list[str] | None]:
        return {
            "`stats`": DEFAULT_ARTIFACT if self.stats is None else self.stats,
            **self.model_inputs(),
            "`labels`": self.labels,
            "`classes`": self.classes,
            "`class_subset`": self.class_subset,
            "`data`": self.data,
            "`recipe`": self.recipe_file(),
            "`source_data`": self.source_data,
            "`methods`": [file for file in map(factory_file, self.method_list()) if file],
        }
