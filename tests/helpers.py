"""Plain helpers shared by several test files: running the CLI and checking its errors, small images, CIFAR batches."""

from __future__ import annotations

import csv
import io
import pickle
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import torch
from conftest import ASSETS, PLAIN, TINY_NET, invoke
from PIL import Image

import cafa_cli
from cafa_cli.data.preprocessing import Preprocessing

# --- the CLI's errors (from test_errors.py) ------------------------------------


def no_traceback(result):
    assert "Traceback" not in result.stdout + result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)


def fails(result, code: int, *needles: str) -> str:
    """Exit `code`, stderr exactly one `cafa: error:` line holding every needle (after any warnings, and
    adapt's lines on its recipe and on what it adapts)."""
    assert result.exit_code == code, (result.exit_code, result.stdout[-500:], result.stderr)
    no_traceback(result)
    lines = [
        line
        for line in result.stderr.strip().splitlines()
        if not line.startswith(("warning:", "adapting ", "recipe ", "no recipe "))
    ]
    assert len(lines) == 1 and lines[0].startswith("cafa: error:"), result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def unless_given(defaults: list, args) -> list:
    """`defaults` (option, value, option, value, ...) less the options `args` give: each option is
    typed once, as a user would (a second one is taken, with a warning)."""
    given = {str(arg).partition("=")[0] for arg in args if str(arg).startswith("--")}
    return [text for name, value in zip(defaults[::2], defaults[1::2]) if name not in given for text in (name, value)]


def options(**given) -> list[str]:
    """Command-line options written as keywords, in the order given: per_class=6 is `--per-class 6`,
    quiet=True is `--quiet`, a list repeats the option (data=[a, b]), None or False leaves it out."""
    args = []
    for key, value in given.items():
        name = "--" + key.replace("_", "-")
        if value is True:
            args.append(name)
        elif isinstance(value, (list, tuple)):
            args += [text for item in value for text in (name, str(item))]
        elif value is not None and value is not False:
            args += [name, str(value)]
    return args


def bench_args(*domains, model=TINY_NET, preprocessing=PLAIN, **given) -> list[str]:
    """`cafa bench DOMAIN...` on the tiny net, its grey images read as they are, and the options
    `given` as keywords (see `options`): bench_args(test, methods="source,bn", workdir=tmp_path / "w").
    model=None, preprocessing=() for the bundled model and its own preprocessing."""
    return ["bench", *map(str, domains), *options(model=model), *preprocessing, *options(**given)]


def bench(*domains, **given):
    return invoke(*bench_args(*domains, **given))


def adapt_args(*data, stats=None, model=TINY_NET, preprocessing=None, **given) -> list[str]:
    """`cafa adapt --data DATA...` on the tiny net, with the options `given` as keywords (see `options`).
    Its grey images are read as they are (PLAIN), unless `stats` names an artifact, which carries its own
    preprocessing."""
    if preprocessing is None:
        preprocessing = PLAIN if stats is None else ()
    return ["adapt", *options(stats=stats, model=model, data=data), *preprocessing, *options(**given)]


def stats_args(data, model=TINY_NET, preprocessing=PLAIN, **given) -> list[str]:
    """`cafa stats --data DATA` on the tiny net, its grey images read as they are, with the options
    `given` as keywords (see `options`)."""
    return ["stats", *options(model=model, data=data), *preprocessing, *options(**given)]


def adapt(setup, data, *args, input=None):
    defaults = unless_given(["--batch-size", "4"], args)
    return invoke(
        "adapt", "--stats", setup["artifact"], "--model", TINY_NET, "--data", data, *defaults, *args, input=input
    )


def stats(setup, data, *args):
    defaults = unless_given([*PLAIN, "--fraction", "1"], args)
    return invoke("stats", "--model", TINY_NET, "--weights", setup["weights"], "--data", data, *defaults, *args)


def rows(result) -> list[dict]:
    return list(csv.DictReader(io.StringIO(result.stdout)))


def factory(tmp_path: Path, body: str, name: str = "net.py") -> str:
    """A model factory file `build()` that can use tiny_net."""
    path = tmp_path / name
    path.write_text(
        f"import sys\nsys.path.insert(0, {str(ASSETS)!r})\nimport torch\nfrom torch import nn\nimport tiny_net\n\n{body}\n"
    )
    return f"{path}:build"


def stats_with_model(setup, tmp_path, model, *extra):
    return invoke(
        "stats",
        "--model",
        model,
        *extra,
        "--data",
        setup["train"],
        *PLAIN,
        "--fraction",
        "1",
        "--out",
        tmp_path / "s.safetensors",
    )


# --- images --------------------------------------------------------------------


GREY = Preprocessing(resize=None, crop=None, mean=(0.0,), std=(1.0,), channels=1)


def save(path: Path, pixels: np.ndarray, fmt: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, format=fmt)
    return path


def solid(value: int, size: int = 8) -> np.ndarray:
    return np.full((size, size), value, dtype=np.uint8)


def _jpeg(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def _bad_image(folder: Path, kind: str) -> Path:
    png = (folder / "a" / "0000.png").read_bytes()
    pixels = np.asarray(Image.open(folder / "a" / "0000.png"))
    if kind == "truncated-png":
        path, data = folder / "b" / "cut.png", png[: len(png) // 2]
    elif kind == "truncated-jpeg":
        jpeg = _jpeg(pixels)
        path, data = folder / "b" / "cut.jpg", jpeg[: len(jpeg) // 2]
    elif kind == "zero-byte":
        path, data = folder / "b" / "empty.png", b""
    elif kind == "not-an-image":
        path, data = folder / "b" / "notes.png", b"these are my notes, not a picture\n"
    elif kind == "postscript":  # Pillow knows it (EPS), but would run Ghostscript to decode it
        path, data = folder / "b" / "page.jpg", b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 16 16\nshowpage\n"
    else:
        raise ValueError(kind)
    path.write_bytes(data)
    return path


# --- CIFAR ---------------------------------------------------------------------


def _py2_string(b) -> bytes:
    b = b.encode("latin1") if isinstance(b, str) else b
    return b"U" + bytes([len(b)]) + b if len(b) < 256 else b"T" + struct.pack("<i", len(b)) + b


def dumps_py2(obj) -> bytes:
    """A pickle byte for byte in the style of Python 2's cPickle protocol 2, as CIFAR's
    batches were written: str as BINSTRING, arrays via numpy.core.multiarray._reconstruct."""

    def enc(o) -> bytes:
        if o is None:
            return b"N"
        if isinstance(o, bool):
            return b"\x88" if o else b"\x89"
        if isinstance(o, int):
            return b"K" + bytes([o]) if 0 <= o < 256 else b"J" + struct.pack("<i", o)
        if isinstance(o, (str, bytes)):
            return _py2_string(o)
        if isinstance(o, tuple):
            return b"(" + b"".join(map(enc, o)) + b"t"
        if isinstance(o, list):
            return b"](" + b"".join(map(enc, o)) + b"e"
        if isinstance(o, dict):
            return b"}(" + b"".join(enc(k) + enc(v) for k, v in o.items()) + b"u"
        assert isinstance(o, np.ndarray) and o.dtype == np.uint8
        dtype = b"cnumpy\ndtype\n" + enc(("u1", 0, 1)) + b"R" + enc((3, "|", None, None, None, -1, -1, 0)) + b"b"
        head = b"cnumpy.core.multiarray\n_reconstruct\n" + b"cnumpy\nndarray\n" + enc((0,)) + enc("b") + b"\x87R"
        return head + b"(" + enc(1) + enc(tuple(o.shape)) + dtype + b"\x89" + _py2_string(o.tobytes()) + b"tb"

    return b"\x80\x02" + enc(obj) + b"."


CIFAR_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def make_cifar10(root: Path, per_batch: int = 3, style: str = "py2") -> tuple[np.ndarray, np.ndarray]:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    protocol = {"py2": None, "py3": 4, "py3-protocol2": 2, "py3-protocol5": 5}[style]
    dump = dumps_py2 if style == "py2" else lambda o: pickle.dumps(_bytes_keys(o), protocol=protocol)
    all_data, all_labels = [], []
    for b in range(1, 6):
        data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, per_batch)]
        batch = {
            "batch_label": f"training batch {b} of 5",
            "labels": labels,
            "data": data,
            "filenames": [f"img_{b}_{i}.png" for i in range(per_batch)],
        }
        (folder / f"data_batch_{b}").write_bytes(dump(batch))
        all_data.append(data)
        all_labels += labels
    meta = {"num_cases_per_batch": per_batch, "label_names": CIFAR_NAMES, "num_vis": 3072}
    (folder / "batches.meta").write_bytes(dump(meta))
    return np.concatenate(all_data), np.array(all_labels)


def _bytes_keys(o):
    """What a Python 3 re-save of the python batches holds (bytes keys and names)."""
    if isinstance(o, dict):
        return {k.encode(): _bytes_keys(v) for k, v in o.items()}
    if isinstance(o, list):
        return [x.encode() if isinstance(x, str) else x for x in o]
    return o


# --- the environment block of the JSON outputs (test_environment.py) -----------------

PACKAGE = Path(cafa_cli.__file__).resolve().parent


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=PACKAGE, capture_output=True, text=True, timeout=30)


def checkout() -> bool:
    """Whether the tests run on a checkout's package (else an installed one, with no commit)."""
    return shutil.which("git") is not None and git("ls-files", "--error-unmatch", "__init__.py").returncode == 0


def check_environment(recorded: dict, device: str = "cpu") -> None:
    """Each field equals what this process says of itself now (the run was in this process)."""
    assert recorded["cafa"] == cafa_cli.__version__
    assert recorded["torch"] == torch.__version__ and recorded["torch_cuda"] == torch.version.cuda
    assert recorded["threads"] == torch.get_num_threads()
    assert recorded["deterministic"] is torch.are_deterministic_algorithms_enabled()
    assert recorded["device"] == device and "device_name" not in recorded  # a CPU has no device name
    assert recorded["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    if not checkout():  # an installed package: its version says which code ran
        assert "commit" not in recorded
        return
    commit, head = recorded["commit"], git("rev-parse", "HEAD").stdout.strip()
    assert commit.removesuffix("-dirty").endswith(head), (commit, head)
    changed = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    assert commit.endswith("-dirty") == bool(changed), (commit, changed)


# the calibration's columns that follow the error's in a bench CSV
CALIBRATION_COLUMNS = [
    "ece_mean_percent",
    "ece_std_percent",
    "nll_mean_nats",
    "nll_std_nats",
    "brier_mean",
    "brier_std",
]


# --- tiny CLIP models (open_clip with random weights: no download) -----------------


def tiny_clip(seed: int = 0, image_size: int = 16, embed_dim: int = 16):
    """An open_clip CLIP small enough for a test: a 2-layer ViT (patch 8) and a 2-layer text
    transformer, random weights from `seed`; with the tokenizer open_clip's models use."""
    import open_clip

    torch.manual_seed(seed)
    model = open_clip.CLIP(
        embed_dim=embed_dim,
        vision_cfg=dict(image_size=image_size, layers=2, width=32, patch_size=8, head_width=16),
        text_cfg=dict(context_length=16, vocab_size=49408, width=32, heads=2, layers=2),
    ).eval()
    return model, open_clip.get_tokenizer("ViT-B-32", context_length=16)


def classifier_methods() -> tuple[str, ...]:
    """The registered methods that run on any classifier: all but the CLIP methods (`needs_clip`),
    which run on a CLIP model's zero-shot classifier alone (tests/test_clip_methods.py), and those that
    need a vision transformer's tokens (`needs_tokens`: tests/test_fidelity_foa.py)."""
    from cafa_cli.methods import REGISTRY, method_class

    return tuple(name for name in REGISTRY if method_class(name).on_any_classifier())
