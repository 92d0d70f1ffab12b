"""A steady-state step never makes the host wait for the device.

On a GPU the host queues kernels and the device runs them later; reading a value the
device computes (`item`, `bool`, `nonzero`, a boolean mask, a copy to the host) waits for
every kernel queued before it, and the device then idles while the host queues the next
ones. The CPU has no such queue, so here the reads themselves are caught: every aten
operator goes through HostReads (a TorchDispatchMode, which also sees those called by
autograd and the optimisers), and the Python-level reads that the dispatcher does not see
(`tolist`, `numpy`, `cpu`) are patched.
"""

from __future__ import annotations

import copy
import traceback

import pytest
import torch
from helpers import classifier_methods
from torch.utils._python_dispatch import TorchDispatchMode

from cafa_cli.engine.adapter import Adapter
from cafa_cli.methods import REGISTRY, create
from cafa_cli.statistics import distances
from cafa_cli.statistics.gaussians import estimate
from cafa_cli.statistics.moments import ClassMoments

NAMES = tuple(REGISTRY)

aten = torch.ops.aten

# operators whose result the host needs at once: item, bool, int and float all end in
# _local_scalar_dense; nonzero, masked_select, unique and a boolean index size their output
WAITS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.equal.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.repeat_interleave.Tensor,
}
INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
PYTHON_READS = ("tolist", "numpy", "cpu", "__array__")


def _where() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if "cafa_cli" in f.filename or "torch/optim" in f.filename]
    return " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in reversed(frames[-3:]))


class HostReads(TorchDispatchMode):
    """While entered, records each read of a tensor's value by the host, except of the
    tensors in `host` (values that live on the host on a GPU too)."""

    current: HostReads | None = None  # the one entered, for the patched Python-level reads

    def __init__(self, host: tuple[torch.Tensor, ...] = ()):
        super().__init__()
        self.host = {t.data_ptr() for t in host}
        self.reads: list[str] = []

    def __enter__(self):
        HostReads.current = self
        return super().__enter__()

    def __exit__(self, *exc):
        HostReads.current = None
        return super().__exit__(*exc)

    def note(self, what: str, tensor) -> None:
        if not (isinstance(tensor, torch.Tensor) and tensor.data_ptr() in self.host):
            self.reads.append(f"{what} at {_where()}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in WAITS and not (func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is not None):
            self.note(str(func), args[0])
        elif func in INDEXING and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]
        ):
            self.note(f"{func} with a boolean mask", args[0])
        return func(*args, **kwargs)


@pytest.fixture(autouse=True)
def python_level_reads(monkeypatch):
    """The reads the dispatcher does not see, noted by the HostReads entered."""
    for name in PYTHON_READS:

        def read(self, *args, _original=getattr(torch.Tensor, name), _name=name, **kwargs):
            if HostReads.current is not None:
                HostReads.current.note(f"Tensor.{_name}", self)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, read)


def steady_reads(adapter: Adapter, x: torch.Tensor, batch: int = 50) -> list[str]:
    """The host's reads in two steps after two warm-up steps (which may create state)."""
    for i in range(2):
        adapter.step(x[i * batch : (i + 1) * batch])
    optimizer = adapter.optimizer
    host = ()
    if optimizer is not None and not optimizer.defaults.get("fused"):
        # torch's unfused Adam keeps its step count on the host, on a GPU too, and reads it
        host = tuple(s["step"] for s in optimizer.state.values() if "step" in s)
    with HostReads(host) as mode:
        for i in range(2, 4):
            adapter.step(x[i * batch : (i + 1) * batch])
    return mode.reads


def gaussians_of(model, x, y, covariance: str):
    with torch.no_grad():
        _, features = model(x)
    moments = ClassMoments(model.num_classes, model.feature_dim)
    moments.update(features, y)
    return estimate(moments, covariance, "auto")


def test_the_recorder_sees_each_kind_of_read():
    """Without this the tests below could pass by seeing nothing."""
    t = torch.tensor([1.0, float("nan")])
    reads = [
        lambda: bool(torch.isfinite(t).all()),
        lambda: t.sum().item(),
        lambda: t.nonzero(),
        lambda: t[t > 0],
        lambda: t.tolist(),
        lambda: t.cpu(),
        lambda: float(t[0]),
        lambda: t.clone().__setitem__(t > 0, 0.0),
    ]
    for read in reads:
        with HostReads() as mode:
            read()
        assert len(mode.reads) == 1, (read, mode.reads)
    with HostReads(host=(t,)) as mode:
        torch.isfinite(t).all()
        t.tolist()  # a host tensor's: allowed
    assert mode.reads == []


# RoTTA's memory bank decides on the host which samples it keeps, each after the one
# before, from one transfer of the batch's pseudo-labels and uncertainties (memory_bank.py):
# that one read a batch and no other (cafa-robust keeps the same bank) (it replaced ~1,300 small device operators a step)
ONE_READ_A_BATCH = {
    "rotta": "Tensor.tolist at memory_bank.py",
    "cmf": "aten.nonzero.default at cmf.py",
    "deyo": "aten.nonzero.default at deyo.py",  # the entropy-kept samples, whose shuffled pass takes their statistics
    "roid": "aten.nonzero.default at roid.py",  # the kept samples, whose views take their own batch statistics
    # SoTTA's and STAMP's memories decide likewise, from one transfer of the confidences (or filter) and classes
    "sotta": "Tensor.tolist at sotta.py",
    "stamp": "Tensor.tolist at stamp.py",
    # OWTTT's threshold, prototype expansion and filter, from one transfer of the scores and cosines
    "owttt": "Tensor.tolist at owttt.py",
}


# cafa-robust reads two more (issue 43): the strength of LAME's correction from the gate's skew,
# once a batch, right after the prediction (the bank's read follows it and waits for the same
# work), and its change detector's statistic once a window of `update_every` images (64: one
# window closes in the two steps of 50 images below), before the batch is predicted.
CAFA_ROBUST_READS = [
    "Tensor.tolist at memory_bank.py",
    "aten._local_scalar_dense.default at cafa_robust.py",
    "aten._local_scalar_dense.default at cafa_robust.py",
]


@pytest.mark.parametrize("method", classifier_methods())
def test_no_step_of_any_method_reads_a_device_value(trained, method):
    model, gaussians, x, _ = trained
    adapter = Adapter(copy.deepcopy(model), create(method, gaussians), lr=1e-2)
    reads = steady_reads(adapter, x)
    if method == "cafa-robust":
        where = sorted(read.split(":")[0] for read in reads)
        assert sorted(2 * CAFA_ROBUST_READS[:2] + CAFA_ROBUST_READS[2:]) == where, reads
        assert sum(" closes <- " in read for read in reads) == 1 and sum(" update <- " in read for read in reads) == 4
    elif method in ONE_READ_A_BATCH:
        assert len(reads) == 2 and all(read.startswith(ONE_READ_A_BATCH[method]) for read in reads), reads  # two steps
    else:
        assert reads == []


@pytest.mark.parametrize("covariance", ["tied", "diag", "lowrank"])
def test_the_distances_refinement_reads_no_device_value(trained, monkeypatch, covariance):
    """These forms recompute some classes exactly (distances.py); with the statistics of
    the test images themselves, each batch has classes to recompute."""
    model, _, x, y = trained
    method = create("cafa", gaussians_of(model, x, y, covariance))
    with torch.no_grad():
        features = model(x[100:150])[1]
    refined = method.distances(features)
    with monkeypatch.context() as patch:
        patch.setattr(distances, "REFINE_TOLERANCE", float("inf"))
        assert not torch.equal(refined, method.distances(features))  # the refinement changed some
    adapter = Adapter(copy.deepcopy(model), method, lr=1e-2)
    assert steady_reads(adapter, x) == []


@pytest.mark.parametrize("optimizer", ["adam", "sgd", "nesterov"])
@pytest.mark.parametrize("fused", [False, True], ids=["undone", "fused"])
@pytest.mark.parametrize("scaled", [False, True], ids=["", "loss-scaled"])
def test_no_optimiser_path_reads_a_device_value(trained, optimizer, fused, scaled):
    """Both ways of leaving out an update (fused found-inf, CUDA's; undone by torch.where,
    the CPU's), with two steps a batch, and with fp16's loss scaler (a CPU one here)."""
    model, gaussians, x, _ = trained
    adapter = Adapter(copy.deepcopy(model), create("cafa", gaussians), optimizer=optimizer, lr=1e-2, steps=2)
    adapter._fused = fused
    adapter.optimizer = adapter._new_optimizer()
    if scaled:
        adapter.scaler = torch.amp.GradScaler("cpu")
    assert steady_reads(adapter, x) == []


@pytest.mark.parametrize(
    "method, covariance",
    [
        ("tent", "full"),
        ("global-fa", "full"),
        ("cafa", "full"),
        ("euclidean", "full"),
        ("cafa", "tied"),
        ("cafa", "diag"),
        ("cafa", "lowrank"),
    ],
)
def test_forward_and_loss_trace_as_one_graph(trained, method, covariance):
    """What --compile compiles for a method that trains: with nothing read on the host, the
    forward pass, the loss and the distances' refinement are one graph (and so is the
    backward pass torch.compile derives from it); only tracing here, no compilation."""
    dynamo = pytest.importorskip("torch._dynamo")
    model, gaussians, x, y = trained
    statistics = gaussians if covariance == "full" else gaussians_of(model, x, y, covariance)
    adapter = Adapter(copy.deepcopy(model), create(method, statistics), lr=1e-2)
    dynamo.reset()
    explained = dynamo.explain(adapter._forward_loss)(x[:50])
    assert (explained.graph_count, explained.break_reasons) == (1, [])


@pytest.mark.parametrize("norm", ["prior:16", "source", "ema:0.05", "class-balanced"])
def test_no_normalisation_setting_reads_a_device_value(trained, norm):
    """The running statistics, the class-mix pass and its gate stay on the device."""
    from test_norms import class_moments_of

    model, gaussians, x, y = trained
    moments = class_moments_of(model, x, y) if norm == "class-balanced" else None
    adapter = Adapter(copy.deepcopy(model), create("cafa", gaussians), lr=1e-2, norm=norm, class_moments=moments)
    assert steady_reads(adapter, x) == []
