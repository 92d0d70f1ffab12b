"""`cafa adapt`'s settings: the test domains, the method, the stream and the outputs."""

from __future__ import annotations

from dataclasses import dataclass, fields

from cafa_cli import DEFAULT_ARTIFACT
from cafa_cli.core.errors import UsageError
from cafa_cli.jobs.config.checks import check, check_gradual_severity, check_max_error, check_seed, factory_file
from cafa_cli.jobs.config.data import InputOptions, ModelOptions, TestDataOptions
from cafa_cli.jobs.config.settings import (
    DATA,
    GATE,
    METHOD,
    MODEL,
    OUTPUT,
    OUTPUT_FILE,
    STREAM,
    AdaptationOptions,
    CccOptions,
    MethodDataOptions,
    OracleOptions,
    OutlierOptions,
    RecipeOptions,
    RecordFormat,
    RuntimeOptions,
    StreamOptions,
    StreamSettings,
    check_oracle,
    parse_method_options,
    setting,
)
from cafa_cli.methods import REGISTRY, is_plugin

# why the run's JSON does not keep `max_error` (the exit code, 4, is cli/errors.EXIT_ABOVE_MAX_ERROR)


@dataclass(kw_only=True)
class AdaptConfig(
    ModelOptions,
    InputOptions,
    TestDataOptions,
    AdaptationOptions,
    RecipeOptions,
    MethodDataOptions,
    OracleOptions,
    StreamOptions,
    OutlierOptions,
    CccOptions,
    RuntimeOptions,
):
    """`cafa adapt`: adapt online over test domains, one prediction per image."""

    data: list[str] = setting(
        help="A test domain (repeatable): image folder, unlabelled folder, .npy array, - (paths on stdin), or a "
        "benchmark such as imagenet-c:ROOT (docs/guides/adapt.md).",
        factory=list,
        flags=("--data", "-d"),
        metavar="PATH",
        panel=DATA,
        brief=True,
        recorded="resolved: the domains as opened, each with its error",
    )
    stats: str | None = setting(
        None,
        f"Artifact from cafa stats (default: {DEFAULT_ARTIFACT}); it also names the model, "
        f"so --model/--weights can be left out.",
        flags=("--stats", "-s"),
        metavar="PATH",
        panel=MODEL,
        brief=True,
        recorded="resolved: the artifact's absolute path, creation time and form",
    )
    method: str = setting(
        "cafa",
        f"The method, one of the {len(REGISTRY)} that cafa methods lists and describes; or a plug-in, "
        f"package.module:factory or file.py:factory (its code runs; the command line only).",
        metavar="NAME",
        panel=METHOD,
        brief=True,
        names_code=True,
    )
    allow_weights_mismatch: bool = setting(
        False,
        "Use the artifact with another model or other weights than it was computed with.",
        panel=MODEL,
        command_line_only=True,
    )
    shuffle: bool = setting(
        StreamSettings.shuffle,
        "Shuffle each domain's stream (seeded).",
        flags=("--shuffle/--no-shuffle",),
        panel=STREAM,
    )
    seed: int = setting(StreamSettings.seed, "Seed of the stream order.", metavar="N", panel=STREAM)
    format: RecordFormat = setting(
        "csv", "Prediction records as csv or jsonl.", panel=OUTPUT, recorded=OUTPUT_FILE, brief=True
    )
    predictions: str | None = setting(
        None,
        "Write the records to this file instead of stdout.",
        metavar="PATH",
        panel=OUTPUT,
        brief=True,
        recorded=OUTPUT_FILE,
    )
    metrics_json: str | None = setting(
        None, "Write errors and settings as JSON.", metavar="PATH", panel=OUTPUT, brief=True, recorded=OUTPUT_FILE
    )
    max_error: float | None = setting(
        None,
        "A CI gate: exit 4 when the error over the labelled images is above PCT %, after every output is written.",
        metavar="PCT",
        panel=OUTPUT,
        recorded=GATE,
    )
    export: str | None = setting(
        None,
        "Write the adapted network for serving, at the end of the stream, its BatchNorms holding the statistics the "
        "stream arrived at; the suffix says the format: .safetensors, a state dict of the model's own architecture, "
        "or .onnx, an ONNX graph with the preprocessing in its metadata (docs/guides/deploy.md).",
        metavar="PATH",
        panel=OUTPUT,
        brief=True,
        recorded=OUTPUT_FILE,
    )
    state: str | None = setting(
        None,
        "Go on from the adaptation state saved in this file (when it is there) and save it there at the end, and "
        "when interrupted: a continual stream (`reset` never) across restarts.",
        metavar="PATH",
        panel=STREAM,
    )

    def __post_init__(self):
        if self.predictions == "-":  # stdout, as without the option
            self.predictions = None
        check_max_error(self.max_error)
        if "reset" in self.chosen():  # else a recipe may still give it: prepare_adaptation checks it then
            self.check_state_reset()
        if self.method not in REGISTRY and not is_plugin(self.method):
            raise UsageError(
                f"`method` must be one of {', '.join(REGISTRY)}, or a plug-in module:factory, not {self.method}"
            )
        check(self)
        check_seed("seed", self.seed)
        if self.data.count("-") > 1:
            raise UsageError("`data` - (image paths on stdin) is given more than once; stdin can be read once")
        check_gradual_severity(self)
        self.method_options()
        if self.oracle:
            check_oracle(self.method)
        if not self.shuffle and self.order != "iid":
            raise UsageError(
                f"`order` {self.order} shuffles in its own way, and `shuffle` is off (the data's own order); "
                f"give one of them"
            )

    def outputs(self) -> dict[str, str | None]:
        # `state` is read and written again by design: an output, kept from every input
        return {
            "`predictions`": self.predictions,
            "`metrics_json`": self.metrics_json,
            "`export`": self.export,
            "`state`": self.state,
        }

    def inputs(self) -> dict[str, str | list[str] | None]:
        return {
            "`stats`": DEFAULT_ARTIFACT if self.stats is None else self.stats,
            **self.model_inputs(),
            "`labels`": self.labels,
            "`classes`": self.classes,
            "`class_subset`": self.class_subset,
            "`subset`": self.subset,
            "`clean`": self.clean,
            "`forgetting`": self.forgetting,
            "`data`": self.data,
            "`recipe`": self.recipe_file(),
            "`method`": factory_file(self.method),
            "`source_data`": self.source_data,
            **self.outlier_inputs(),
        }

    def check_state_reset(self, origin: str = "") -> None:
        """`state` goes on with a continual stream: `reset` never. `origin` says where a `reset`
        the user did not give came from (" (the default)", " (from the recipe X)")."""
        if self.state is None or self.reset == "never":
            return
        if self.reset.startswith("every:"):
            raise UsageError(
                f"`state` goes on with a continual stream and does not keep the count of updates of `reset` "
                f"{self.reset}{origin}: give `reset` never"
            )
        raise UsageError(
            f"`state` goes on with a continual stream, and `reset` {self.reset}{origin} starts each "
            f"{'batch' if self.reset == 'episodic' else 'domain'} from the source model: give `reset` never"
        )

    def method_options(self) -> dict:
        """`method_option` as {option: value} for `method`, each checked against the
        options a built-in method declares (a plug-in's are checked when it is made)."""
        given = {}
        for method, name, value in parse_method_options(self.method_option):
            if method not in (None, self.method):
                raise UsageError(
                    f"`method_option` {method}.{name}={value} is for the method {method}, and `method` is "
                    f"{self.method}; give it as {name}={value} with `method` {method}, or drop it"
                )
            given[name] = value
        if given and not is_plugin(self.method):
            from cafa_cli.engine.options import resolve_options
            from cafa_cli.methods import options_of

            resolve_options(self.method, options_of(self.method), given)
        return given

    def stream_settings(self) -> StreamSettings:
        """What the online loop is told (jobs/adapt/stream.adapt_domains); `consistency` is no option of
        adapt's but what a bench asks of its runs (Adaptation.consistency)."""
        return StreamSettings(
            **{f.name: getattr(self, f.name) for f in fields(StreamSettings) if f.name != "consistency"}
        )
