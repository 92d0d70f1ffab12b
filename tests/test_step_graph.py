"""The CUDA graph step (step_graph.py) on the CPU, with an emulated capture: the logic
that decides when a step is captured, checked, replayed or run eagerly, and the rule a
replayable method must keep (its state changes in place), for every method that says so.

The emulated capture runs the step function again at each replay, on the graph's input
buffer, as a real replay runs the captured kernels on the captured addresses. What it
cannot show, a GPU must: that the kernels are captured at all (benchmarks/gpu_checks.sh)."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from test_norms import class_moments_of
from torch.utils._python_dispatch import TorchDispatchMode

from cafa_cli.core.errors import UsageError
from cafa_cli.engine import step_graph
from cafa_cli.engine.adapter import WRITTEN, Adapter
from cafa_cli.engine.method import Method
from cafa_cli.engine.options import AdapterSettings
from cafa_cli.engine.step_graph import WARMUP, StepGraph, kept_state
from cafa_cli.methods import REGISTRY, create
from cafa_cli.methods.tent import Tent

NAMES = tuple(REGISTRY)

CAPTURABLE = [
    "tent",
    "pl",
    "cafa",
    "intra",
    "euclidean",
    "global-fa",
    "eta",
    "eata",
    "cafa-eata",
    "bn",
    "source",
    "lame",
    "sar",
    "rdumb",
    "rpl",
    "shot-im",
    "shot",
    "neo",
]


class Emulated:
    """A capture that records the step function and runs it at each replay."""

    captures = 0

    def __init__(self, function, stream):
        Emulated.captures += 1
        self.function = function

    def replay(self) -> torch.Tensor:
        return self.function()


class Perturbed(Emulated):
    """A replay whose prediction is off: what a step frozen at capture time would give."""

    def replay(self) -> torch.Tensor:
        return self.function() + 0.5


class Refused(Emulated):
    def __init__(self, function, stream):
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")


def adapter_pair(trained, method: str = "tent", capture=Emulated, fused: bool = True, method_options=None, **options):
    """An Adapter stepping through StepGraph (CUDA's fused optimiser, an emulated capture) and an eager twin."""
    model, gaussians, x, y = trained
    if options.get("norm") == "class-balanced":
        options["class_moments"] = class_moments_of(model, x, y)
    made = []
    for _ in range(2):
        adapter = Adapter(copy.deepcopy(model), create(method, gaussians, **(method_options or {})), lr=1e-2, **options)
        if adapter.optimizer is not None:
            adapter._fused = fused
            adapter.optimizer = adapter._new_optimizer()
        made.append(adapter)
    graphed, eager = made
    graphed.graph = StepGraph(
        graphed._eager_step, graphed._kept_state, graphed.device, capture=capture, written=WRITTEN
    )
    return graphed, eager


def stream_of(x: torch.Tensor, sizes=(40, 40, 40, 40, 40, 40, 20)) -> list[torch.Tensor]:
    starts = torch.tensor((0,) + sizes).cumsum(0).tolist()
    return [x[a:b] for a, b in zip(starts, starts[1:])]


def run_both(graphed: Adapter, eager: Adapter, batches) -> None:
    for i, images in enumerate(batches):
        assert torch.equal(graphed.step(images), eager.step(images)), f"batch {i}: {graphed.step_runner}"
    for (name, value), other in zip(graphed.model.state_dict().items(), eager.model.state_dict().values()):
        assert torch.equal(value, other), name


@pytest.mark.parametrize("norm", ["batch", "prior:4", "source", "ema:0.05", "class-balanced"])
@pytest.mark.parametrize("method", CAPTURABLE)
def test_every_replayable_method_is_replayed_with_the_eager_predictions_bit_for_bit(trained, method, norm):
    """Warm-up, capture checked against an eager step (whose state it puts back: the
    replay after it starts where the eager twin's step did), replays, and a shorter last
    batch run eagerly beside the graph: every prediction and weight as the eager twin's."""
    graphed, eager = adapter_pair(trained, method, norm=norm)
    assert graphed.method.capturable
    _, _, x, _ = trained
    batches = stream_of(x)
    run_both(graphed, eager, batches)
    assert graphed.step_runner == "graph"
    assert graphed.graph.replays == len(batches) - WARMUP - 1  # the last, shorter batch ran eagerly
    assert graphed.skipped_steps == eager.skipped_steps
    if graphed.method.filters_samples:
        assert graphed.kept_samples == eager.kept_samples > 0


aten = torch.ops.aten
# what a captured step cannot do on a GPU, seen here as the operators dispatched: a tensor
# made from Python data is copied from pageable host memory (refused during a capture), and
# random numbers would differ between the checked eager step and the replay
UNCAPTURABLE = {
    aten.lift_fresh.default,
    aten.lift_fresh_copy.default,
    aten.randn.default,
    aten.rand.default,
    aten.randint.low,
    aten.randint.default,
    aten.randperm.default,
    aten.normal_.default,
    aten.uniform_.default,
    aten.bernoulli_.float,
    aten.bernoulli.default,
    aten.bernoulli.p,
    aten.multinomial.default,
    aten.exponential_.default,
}


class Uncapturable(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in UNCAPTURABLE:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_recorder_sees_what_a_capture_cannot_hold():
    with Uncapturable() as mode:
        torch.tensor(1.0), torch.as_tensor([1.0]), torch.randn(2), torch.empty(2).uniform_(), torch.randperm(3)
    assert len(mode.seen) == 5


@pytest.mark.parametrize("norm", ["batch", "ema:0.05", "class-balanced"])
@pytest.mark.parametrize("method", CAPTURABLE)
def test_no_replayable_step_makes_tensors_from_python_data_or_draws_random_numbers(trained, method, norm):
    graphed, _ = adapter_pair(trained, method, capture=Emulated, norm=norm)
    _, _, x, _ = trained
    batches = stream_of(x)
    for images in batches[:WARMUP]:
        graphed.step(images)
    with Uncapturable() as mode:
        graphed._eager_step(batches[WARMUP])  # what the capture records
    assert mode.seen == []


@pytest.mark.parametrize(
    "method, optimizer, method_options",
    [
        ("cafa", "adam", {}),
        ("tent", "nesterov", {}),
        ("sar", "sgd", {}),
        ("sar", "sgd", {"reset_below": 10.0}),  # its recovery on every batch: parameters and optimiser state put back
    ],
)
@pytest.mark.parametrize("fused", [False, True], ids=["undone", "fused"])
def test_the_optimiser_state_replays_as_it_steps(trained, fused, method, optimizer, method_options):
    """Adam's moments and step count (fused: on the device, made on the first step) and
    SGD's momentum change in place, as does SAR's recovery of them."""
    graphed, eager = adapter_pair(trained, method, fused=fused, method_options=method_options, optimizer=optimizer)
    _, _, x, _ = trained
    run_both(graphed, eager, stream_of(x))
    for p, q in zip(graphed.params, eager.params):
        for key, value in graphed.optimizer.state[p].items():
            assert torch.equal(value, eager.optimizer.state[q][key]), key
    assert graphed.step_runner == "graph"


def test_the_warm_up_counts_batches_of_the_captured_shape_in_a_row(trained):
    """A step's first batch of a shape may make state and caches (a capture must not): the
    capture waits for WARMUP batches of its shape in a row."""
    graphed, eager = adapter_pair(trained, "sar", norm="class-balanced")
    _, _, x, _ = trained
    run_both(graphed, eager, stream_of(x, sizes=(40, 40, 20, 40, 40, 40, 40, 20)))
    assert graphed.step_runner == "graph" and graphed.graph.replays == 1  # the 7th batch: captured, checked, replayed
    graphed.step(x[:40])
    assert graphed.graph.replays == 2


def test_reset_drops_the_graph_and_the_next_stream_warms_up_again(trained):
    graphed, eager = adapter_pair(trained, "eata")
    _, _, x, _ = trained
    before = Emulated.captures
    for _ in range(2):
        run_both(graphed, eager, stream_of(x))
        graphed.reset()
        eager.reset()
        assert graphed.step_runner == "eager: warming up"
    assert Emulated.captures - before == 2


class Counting(Tent):
    """A plug-in that says it is replayable but keeps a Python count or replaces a tensor."""

    name = "counting"
    capturable = True  # said, wrongly

    def __init__(self, keep: str):
        super().__init__()
        self.keep, self.count, self.total = keep, 0, torch.zeros(())

    def loss(self, logits, features):
        if self.keep == "python":
            self.count += 1
        else:
            self.total = self.total + 1
        return super().loss(logits, features)


@pytest.mark.parametrize("keep, moved", [("python", "method.count"), ("tensor", "method.total")])
def test_a_step_that_keeps_state_out_of_place_is_never_captured(trained, keep, moved):
    model, _, x, _ = trained
    graphed = Adapter(copy.deepcopy(model), Counting(keep), lr=1e-2)
    graphed.graph = StepGraph(
        graphed._eager_step, graphed._kept_state, graphed.device, capture=Emulated, written=WRITTEN
    )
    before = Emulated.captures
    for images in stream_of(x):
        graphed.step(images)
    assert graphed.step_runner == f"eager: a step replaces or moves {moved}"
    assert Emulated.captures == before


@pytest.mark.parametrize(
    "capture, why",
    [
        (Perturbed, "eager: a replay did not match the eager step"),
        (Refused, "eager: the capture failed (operation not permitted when stream is capturing)"),
    ],
)
def test_a_capture_that_fails_or_does_not_match_leaves_the_eager_step_in_place(trained, capture, why):
    graphed, eager = adapter_pair(trained, "cafa", capture=capture)
    _, _, x, _ = trained
    run_both(graphed, eager, stream_of(x))
    assert graphed.step_runner == why
    assert graphed.graph.replays == 0


def test_the_check_tolerates_rounding_but_not_a_wrong_value():
    value = torch.tensor([1.0, -2.0, 3.0, float("nan")])
    assert step_graph._close(value + 1e-6, value)
    assert not step_graph._close(value + 0.1, value)
    assert not step_graph._close(torch.tensor([1.0, -2.0, 3.0, 0.0]), value)
    assert step_graph._close(torch.tensor([1, 2]), torch.tensor([1, 2])) and not step_graph._close(
        torch.tensor([1, 2]), torch.tensor([1, 3])
    )


def test_oracle_labels_turn_the_graph_off(trained):
    graphed, eager = adapter_pair(trained, "cafa")
    _, _, x, y = trained
    for images, labels in zip(stream_of(x), stream_of(y)):
        graphed.method.oracle_labels = eager.method.oracle_labels = labels
        assert torch.equal(graphed.step(images), eager.step(images))
    assert graphed.step_runner == "eager: oracle labels change every batch"


def test_the_replayable_methods_are_the_ones_tested_here(trained):
    _, gaussians, _, _ = trained
    assert sorted(name for name in NAMES if create(name, gaussians).capturable) == sorted(CAPTURABLE)
    # and the ones the adapt guide's --cuda-graph paragraph names, each list in full
    from pathlib import Path

    guide = " ".join((Path(__file__).parents[1] / "docs" / "guides" / "adapt.md").read_text().split())
    replayed = guide.split("the steady-state step of ")[1].split(" is captured")[0]
    eager = guide.split("the other methods (")[1].split(")")[0]
    assert sorted(set(re.findall(r"[a-z][a-z0-9-]*", replayed)) & set(NAMES)) == sorted(CAPTURABLE), replayed
    assert sorted(eager.split(", ")) == sorted(set(NAMES) - set(CAPTURABLE)), eager


def test_a_subclass_that_changes_the_step_is_replayed_only_when_it_says_so():
    class Louder(Tent):
        def loss(self, logits, features):
            return 2 * super().loss(logits, features)

    class Named(Tent):
        name = "named"

    assert Tent.capturable and Named.capturable and not Louder.capturable


def test_the_graph_is_on_by_default_since_it_was_measured_on_a_gpu(trained):
    """Issue 45: opt-in until its first run on a GPU (an H200: steps 1.0-1.6x faster, every
    replayable method captured), on by default since, in the Python API, the settings and
    the command line alike; the CPU runs eagerly and says why."""
    from cafa_cli.jobs.config import AdaptConfig, BenchConfig

    model, _, _, _ = trained
    adapter = Adapter(copy.deepcopy(model), create("tent"))
    assert adapter.graph is None and adapter.step_runner == "eager: CUDA graphs need CUDA, not cpu"
    assert AdaptConfig().cuda_graph is True and BenchConfig().cuda_graph is True
    assert AdapterSettings().cuda_graph is True and adapter.settings.cuda_graph is True
    off = Adapter(copy.deepcopy(model), create("tent"), cuda_graph=False)
    assert off.step_runner == "eager: cuda_graph is off"


def test_why_a_step_runs_eagerly(trained):
    model, gaussians, _, _ = trained
    adapter = Adapter(copy.deepcopy(model), create("tent"), cuda_graph=True)
    assert adapter.graph is None and adapter.step_runner == "eager: CUDA graphs need CUDA, not cpu"
    adapter.device = torch.device("cuda")  # what the Adapter would decide on a GPU
    why = adapter._why_no_graph
    assert why(AdapterSettings()) is None and why(AdapterSettings(precision="bf16")) is None
    assert why(AdapterSettings(cuda_graph=False)) == "cuda_graph is off"
    assert why(AdapterSettings(precision="fp16")) == "fp16's loss scale moves on the host"
    assert why(AdapterSettings(compile=True)) == "torch.compile makes its own graphs"
    for name in ("cotta", "rotta", "t3a", "cafa-robust"):
        adapter.method = create(name, gaussians)
        assert why(AdapterSettings()) == f"{name}'s step is not replayable as a CUDA graph"


def test_the_option_must_be_true_or_false(trained):
    model, _, _, _ = trained
    with pytest.raises(UsageError, match="`cuda_graph` must be true or false"):
        Adapter(copy.deepcopy(model), create("tent"), cuda_graph="yes")


def test_kept_state_walks_the_method_but_not_modules_or_per_batch_values():
    class Holder(Method):
        pass

    holder = Holder()
    holder.inner = {"a": [torch.zeros(2), 3]}
    holder.net = torch.nn.Linear(2, 2)
    holder.leave_out = torch.ones(())
    state = kept_state({"method": holder}, skip=Method.per_batch)
    assert set(state) == {"method.inner.a.0", "method.inner.a.1"}


@pytest.mark.parametrize("capture", [Emulated, Perturbed])
def test_adapt_records_what_ran_the_steps_and_warns_when_the_check_turned_the_graph_off(
    setup, tmp_path, monkeypatch, capture
):
    """`cafa adapt` as on a GPU (the graph allowed on the CPU here, the capture emulated):
    the same records as --no-cuda-graph, `step_runner` in the metrics, and one warning when
    the check failed."""
    from functools import partial

    from helpers import adapt

    from cafa_cli.engine import adapter as adapter_module

    data = setup["train"]
    eager = adapt(setup, data, "--method", "tent", "--no-cuda-graph", "--metrics-json", tmp_path / "eager.json")
    monkeypatch.setattr(adapter_module.Adapter, "_why_no_graph", lambda self, *settings: None)
    monkeypatch.setattr(adapter_module, "StepGraph", partial(StepGraph, capture=capture))
    graphed = adapt(setup, data, "--method", "tent", "--cuda-graph", "--metrics-json", tmp_path / "graph.json")
    assert eager.exit_code == graphed.exit_code == 0, graphed.stderr
    assert graphed.stdout == eager.stdout  # 18 images in batches of 4: 3 warm-up, a checked capture, the last 2 eager
    runner = json.loads((tmp_path / "graph.json").read_text())["settings"]["step_runner"]
    assert json.loads((tmp_path / "eager.json").read_text())["settings"]["step_runner"] == "eager: cuda_graph is off"
    warnings = [line for line in graphed.stderr.splitlines() if "steps ran eagerly" in line]
    if capture is Emulated:
        assert runner == "graph" and warnings == []
    else:
        assert runner == "eager: a replay did not match the eager step"
        assert warnings == [
            "warning: the steps ran eagerly: a replay did not match the eager step; the predictions are the "
            "eager step's (--no-cuda-graph skips the attempt)"
        ]


def test_no_garbage_is_collected_while_a_step_is_captured(monkeypatch):
    """A collection during a capture that frees an earlier CUDA graph ends the capture (seen
    once in 78 captures on an H200, pytorch/pytorch#161037): garbage is collected before the
    capture, none during it, and the collector is back on after it, even when it fails."""
    import gc
    from contextlib import nullcontext

    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: None)
    monkeypatch.setattr(torch.cuda, "graph", lambda *args, **kwargs: nullcontext())
    freed = []

    class Cycle:
        def __init__(self):
            self.me = self

        def __del__(self):
            freed.append("before the capture")

    Cycle()
    seen = []

    def step():
        seen.append((gc.isenabled(), list(freed)))
        return torch.zeros(1)

    step_graph.CudaCapture(step, None)
    assert seen == [(False, ["before the capture"])] and gc.isenabled()

    def failing():
        raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.raises(RuntimeError):
        step_graph.CudaCapture(failing, None)
    assert gc.isenabled()
