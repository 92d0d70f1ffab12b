"""The statistics a bench needs, computed once per covariance mode (and training fraction)
in its workdir and re-used while they still match the bench's model, data and settings."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cafa_cli.artifact.provenance import model_mismatch
from cafa_cli.artifact.store import read_artifact
from cafa_cli.core.errors import InputError, listing, printable, undecodable
from cafa_cli.core.files import atomic_write, open_lock_file
from cafa_cli.data.domain import read_class_list
from cafa_cli.data.sources import open_domain
from cafa_cli.jobs.bench.rows import Row
from cafa_cli.jobs.bench.runs import same_shrinkage, stats_config
from cafa_cli.jobs.config import BenchConfig, StatsConfig
from cafa_cli.jobs.shared.distributed import wait_for_all
from cafa_cli.jobs.shared.inputs import default_class_names, recipe, recorded_data, resolve_model
from cafa_cli.jobs.shared.monitor import Monitor
from cafa_cli.jobs.stats import Sample, compute_statistics, sample_keys
from cafa_cli.model.loading import bundled_model


def covariances_needed(rows: list[Row]) -> list[str]:
    """The covariance modes of the artifacts the rows use, one each, in a fixed order."""
    return sorted({row.covariance for row in rows if row.covariance})


def statistics_needed(rows: list[Row]) -> list[tuple[str, float | None]]:
    """The artifacts the rows read, as (covariance, fraction on a sweep), each once, in a fixed order."""
    return sorted({row.statistics for row in rows if row.statistics}, key=lambda key: (key[0], key[1] or 0))


def artifact_path(workdir: Path, covariance: str, fraction: float | None = None) -> Path:
    """One artifact a covariance mode, and on a fraction sweep one a fraction too (`stats-auto-fraction0.01`)."""
    return workdir / (
        f"stats-{covariance}.safetensors" if fraction is None else f"stats-{covariance}-fraction{fraction}.safetensors"
    )


def ensure_statistics(
    config: BenchConfig,
    covariance: str,
    monitor: Monitor,
    fraction: float | None = None,
    rank: int = 0,
    world: int = 1,
) -> Path:
    """The artifact for one covariance mode (at `fraction`, on a sweep), re-used when it was
    made for the same model and data; computed on the device, batch size and loader
    processes of the bench. Checked, computed and written under the artifact's lock, so
    that a second bench sharing the workdir waits for the first and re-uses its artifact.
    Under torchrun the ranks compute it together, and rank 0, which writes it, holds the lock."""
    path = artifact_path(Path(config.workdir), covariance, fraction)
    stats = stats_config(config, covariance, path, fraction=fraction)
    with statistics_lock(path, monitor, hold=rank == 0):
        wait_for_all(world)  # no rank looks at the artifact before rank 0 holds its lock
        if path.is_file():
            why, sample = _check(path, stats)
            if why is None and sample is not None:
                monitor.info(
                    f"re-using statistics in {path}, made from the same {_images(sample)} (sizes and times unchanged)"
                )
                return path
            if why:
                monitor.info(f"not re-using statistics in {path}: {why}")
        at = "" if fraction is None else f", `fraction` {fraction}"
        monitor.info(f"computing statistics (`covariance` {covariance}{at}) → {path}")
        compute_statistics(stats, monitor)  # written (on rank 0) before it returns, so before the lock goes
    return path


def _check(path: Path, stats: StatsConfig) -> tuple[str | None, Sample | None]:
    """_mismatch of the artifact at `path`; '' where the model or data cannot be opened
    (compute_statistics then says what is wrong with them, as an error)."""
    try:
        artifact = read_artifact(path, load_tensors=False)
    except InputError as error:
        return f"it is not a readable artifact ({error})", None
    try:
        return _mismatch(artifact, stats)
    except InputError:
        return "", None


def _images(sample: Sample) -> str:
    """'18 images', or for images from arrays '18 images of train-images-idx3-ubyte.gz'."""
    noun = f"{sample.images} image{'' if sample.images == 1 else 's'}"
    if sample.files is None or len(sample.files) == sample.images:
        return noun
    return f"{noun} of {listing(Path(file).name for file in sample.files)}"


@contextmanager
def statistics_lock(artifact: Path, monitor: Monitor, hold: bool = True) -> Iterator[None]:
    """An exclusive lock (flock) on the artifact's lock file while the block runs (with
    `hold`); when another process holds it, says so and waits. Where no lock can be had
    the block runs without one: the artifact is still written whole (atomically), only
    perhaps computed twice. The lock goes when the file is closed, or with the process
    however it ends; the file stays (removing it would let a third process lock a new file
    while a second still waits on the old one)."""
    lock = open_lock_file(artifact) if hold else None  # one an artifact: benches of other statistics do not wait
    if lock is None:
        yield
        return
    try:
        _take(lock, artifact, monitor)
        yield
    finally:
        os.close(lock)


def _take(lock: int, artifact: Path, monitor: Monitor) -> None:
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        monitor.info(
            f"waiting for another process (a bench with the same `workdir`) that holds the lock on {artifact}; "
            f"its statistics are re-used if they fit"
        )
        fcntl.flock(lock, fcntl.LOCK_EX)  # Ctrl-C still interrupts the wait (PEP 475: the handler raises)
    except OSError:  # a file system without locks (some network mounts)
        pass


def shared_class_list(config: BenchConfig, workdir: Path, artifacts: dict[str, Path], write: bool = True) -> str | None:
    """The class list file every row uses, so that the rows without statistics read the
    labels in the model's output order too. Without it they take the test folders'
    sorted names, which is not the order of every training set (Fashion-MNIST's is not
    alphabetical), while the rows with statistics take the artifact's.
    --classes or a bundled model already fix it; else the training data's order is
    written to WORKDIR/classes.txt (by `write`: rank 0 under torchrun); None when there
    is no training data to ask, or it has no class folders."""
    if config.classes or bundled_model(config.model):
        return config.classes
    if artifacts:  # the names of all the model's outputs: a class subset's artifact has the subset's as class_names
        names = read_artifact(next(iter(artifacts.values())), load_tensors=False).model_class_names
    elif config.train:
        names = open_domain(config.train, None, option="train").class_names
    else:
        return None
    if not names:
        return None
    # the list is a UTF-8 text file of stripped lines: undecodable bytes (as os.fsdecode keeps
    # them), spaces around a name or a line break in it would not come back
    unwritable = [n for n in names if any(undecodable(ch) for ch in n) or n != n.strip() or len(n.splitlines()) > 1]
    if unwritable:
        raise InputError(
            f"class folder {printable(repr(unwritable[0]))} cannot go into the class list file for the rows without "
            f"statistics (a name that is not UTF-8, or spaces around it); rename it"
        )
    path = workdir / "classes.txt"
    if write:
        atomic_write(path, lambda tmp: Path(tmp).write_text("".join(f"{name}\n" for name in names), encoding="utf-8"))
    return str(path)


def _mismatch(artifact, stats: StatsConfig) -> tuple[str | None, Sample | None]:
    """Why an artifact does not hold these statistics (None when it does), and the sample
    they would be made from (None where it was not needed to tell). Compared as
    compute_statistics records them (absolute paths: a relative --train or --workdir must
    match on a second run), as cafa adapt checks the model (the same parameters in another
    file are the same), and by the sizes and modification times of the files the images
    are read from (an image edited in place under its name is another image)."""
    why = _other_settings(artifact, stats)
    if why is not None:
        return why, None
    net, spec = resolve_model(stats, default_class_names(stats.model, stats))
    why = model_mismatch(artifact, spec, net)
    if why is not None:
        return why, None
    # the same folder may hold other images since (added, removed, relabelled), or the same
    # ones edited in place: compare the sample drawn, then its files' sizes and times
    sample = sample_keys(stats)
    recorded = artifact.sampling.get("images_sha256"), artifact.sampling.get("file_stamps")
    if recorded[0] is None:
        return "it was made before cafa recorded which images a sample holds", sample
    if recorded[0] != sample.images_sha256:
        return "the images drawn differ (images added to, removed from or relabelled in the training data)", sample
    if sample.file_stamps is None:  # arrays of a kind source_files does not know: whether they changed is unknown
        return "the files these images are read from are not known, so whether they changed cannot be told", sample
    if recorded[1] is None:
        return "it was made before cafa recorded the sizes and modification times of the images", sample
    if recorded[1] != sample.file_stamps:
        return (
            f"the training images changed since: the same {_images(sample)} by name and label, but other sizes "
            f"or modification times (edited or replaced in place)"
        ), sample
    return None, sample


def _other_settings(artifact, stats: StatsConfig) -> str | None:
    """Why an artifact was made with other settings than these, or None."""
    if stats.classifier not in (None, artifact.model.classifier):
        return "it was made with another `classifier`"
    if stats.classes is not None and read_class_list(stats.classes) != artifact.model_class_names:
        return "it was made with another class list (`classes`)"
    subset = set(read_class_list(stats.class_subset, "class_subset")) if stats.class_subset else None
    if subset != (set(artifact.class_names) if "class_subset" in artifact.metadata else None):
        return "it was made for another `class_subset`"
    if artifact.preprocessing != recipe(stats, stats.model):
        return "it was made with other preprocessing"
    if artifact.sampling.get("data") != recorded_data(stats.data):
        return f"it was made from other training data ({printable(str(artifact.sampling.get('data')))})"
    fraction, per_class = stats.training_sample()
    wanted = {"fraction": fraction, "per_class": per_class, "seed": stats.seed}
    if any(artifact.sampling.get(key) != value for key, value in wanted.items()):
        return "it was made from another sample of the training data (another `fraction`, `per_class` or seed)"
    if not same_shrinkage(stats.shrinkage_value(), artifact.metadata.get("shrinkage"), artifact.covariance):
        return "it was made with another `shrinkage`"
    if stats.norm_moments and "norm_layers" not in artifact.metadata:
        return "it holds no class moments of the normalisation layers' inputs, which `norm` class-balanced needs"
    return None
