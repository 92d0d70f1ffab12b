"""cafa's Python API: every name here is supported (docs/reference/python-api.md documents each);
anything else in `cafa_cli` is internal and may change.

    from cafa_cli.api import Adapter, create, load_model, read_artifact

The map, in the order a run uses it:

- Models: `load_model` (the model `--model`/`--weights` name, wrapped as a
  `FeatureClassifier`: forward returns logits and features), `model_spec` and `ModelSpec`
  (how an artifact records it), `parameters_sha256` (the fingerprint of its weights).
- Images as the command line reads them: `open_domain` (one `--data` value), `batches`
  (its images resized and cropped, uint8), `Preprocessing` (resize, crop, mean, std;
  `normalize` makes the model's input); `load_fashion_mnist` and `FASHION_MNIST_CLASSES`
  (the bundled model's data set, from the local cache).
- Class statistics: `ClassMoments` (accumulated features), `estimate` (moments ->
  `ClassGaussians`), `ClassDistances` (squared Mahalanobis distances to each class);
  `write_artifact` and `read_artifact` (the file `cafa stats` writes).
- Adaptation: `Adapter` (predict, then update, for any method), `AdapterSettings` (its
  settings, checked; they unpack as its keywords), `Norm` (a parsed `norm`), `pick_device` (the
  device `auto` means, checked), `create` (a method by name), `REGISTRY` (the built-in
  methods), `method_class` (a built-in method's class: what it needs and does),
  `options_of` (a method's `Option`s), `shipped` (a method's published recipe), `losses`
  (the objectives as plain functions).
- A method of your own: `Method` (the protocol), `Option` (an option it declares),
  `AdapterSurface` (what of the Adapter a method that runs its own update may touch).
- Whole jobs, as the command line runs them: `StatsConfig`, `AdaptConfig`, `BenchConfig`,
  `DemoConfig`, `FeaturesPlotConfig` (a command's settings, checked when built);
  `compute_statistics`, `run_adapt`, `run_bench` (the commands' work); `Monitor` (their
  progress and warnings, shown nowhere).
- Errors: `CafaError` (what the command line reports in one line), its `UsageError` (a bad
  argument) and `InputError` (a file or input that cannot be used).

The command line does not import this module (it imports torch, which `cafa --help` must
not wait for); tests/test_api.py keeps `__all__` and the documentation the same.
"""

from cafa_cli.artifact.store import read_artifact, write_artifact
from cafa_cli.core.devices import pick_device
from cafa_cli.core.errors import CafaError, InputError, UsageError
from cafa_cli.data.fashion_mnist import FASHION_MNIST_CLASSES, load_fashion_mnist
from cafa_cli.data.loading import batches
from cafa_cli.data.preprocessing import Preprocessing
from cafa_cli.data.sources import open_domain
from cafa_cli.engine.adapter import Adapter
from cafa_cli.engine.method import AdapterSurface, Method
from cafa_cli.engine.options import AdapterSettings, Norm, Option
from cafa_cli.jobs.adapt import run as run_adapt
from cafa_cli.jobs.bench import run as run_bench
from cafa_cli.jobs.config import AdaptConfig, BenchConfig, DemoConfig, FeaturesPlotConfig, StatsConfig
from cafa_cli.jobs.shared.monitor import Monitor
from cafa_cli.jobs.stats import compute_statistics
from cafa_cli.methods import REGISTRY, create, method_class, options_of
from cafa_cli.methods.recipes import shipped
from cafa_cli.methods.shared import losses
from cafa_cli.model.features import FeatureClassifier
from cafa_cli.model.loading import ModelSpec, load_model, model_spec, parameters_sha256
from cafa_cli.statistics.distances import ClassDistances
from cafa_cli.statistics.gaussians import ClassGaussians, estimate
from cafa_cli.statistics.moments import ClassMoments

__all__ = [
    # models
    "load_model",
    "FeatureClassifier",
    "model_spec",
    "ModelSpec",
    "Norm",
    "parameters_sha256",
    # images
    "open_domain",
    "batches",
    "Preprocessing",
    "load_fashion_mnist",
    "FASHION_MNIST_CLASSES",
    # class statistics and their file
    "ClassMoments",
    "estimate",
    "ClassGaussians",
    "ClassDistances",
    "write_artifact",
    "read_artifact",
    # adaptation
    "Adapter",
    "AdapterSettings",
    "pick_device",
    "create",
    "REGISTRY",
    "method_class",
    "options_of",
    "shipped",
    "losses",
    # a method of your own
    "Method",
    "Option",
    "AdapterSurface",
    # whole jobs
    "StatsConfig",
    "AdaptConfig",
    "BenchConfig",
    "DemoConfig",
    "FeaturesPlotConfig",
    "compute_statistics",
    "run_adapt",
    "run_bench",
    "Monitor",
    # errors
    "CafaError",
    "UsageError",
    "InputError",
]
