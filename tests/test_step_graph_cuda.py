"""The CUDA-graph step on a real GPU (issue 45): what tests/test_step_graph.py emulates on
the CPU, captured and replayed by CUDA itself. Skipped without CUDA; benchmarks/gpu_checks.sh
runs it first on a lent device (its `capture` stage).

A replay runs the kernels the capture recorded, so on the device it must give what the
eager step gives: the same predicted classes and logits within the tolerance the capture's
own check allows (cuDNN's reductions need not round alike from one launch to the next). A
method whose step cannot be replayed must say why and run eagerly.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import classifier_methods
from test_norms import class_moments_of
from test_step_graph import CAPTURABLE, stream_of

from cafa_cli.engine.adapter import Adapter
from cafa_cli.engine.step_graph import TOLERANCE, WARMUP
from cafa_cli.methods import create

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def pair(trained, method: str, norm: str = "batch", precision: str = "fp32"):
    model, gaussians, x, y = trained
    options = {"norm": norm, "precision": precision, "lr": 1e-2}
    if norm == "class-balanced":
        options["class_moments"] = class_moments_of(model, x, y)
    return [
        Adapter(copy.deepcopy(model), create(method, gaussians, "cuda"), "cuda", cuda_graph=graph, **options)
        for graph in (True, False)
    ]


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a.float() - b.float()).abs().max() <= TOLERANCE * max(b.float().abs().max().item(), 1.0))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("norm", ["batch", "ema:0.05", "class-balanced"])
@pytest.mark.parametrize("method", CAPTURABLE)
def test_a_replayable_step_is_captured_on_the_gpu_and_replays_what_the_eager_step_does(
    trained, method, norm, precision
):
    graphed, eager = pair(trained, method, norm, precision)
    batches = stream_of(trained[2])
    for i, images in enumerate(batches):
        replayed, stepped = graphed.step(images), eager.step(images)
        assert close(replayed, stepped), f"batch {i}: {graphed.step_runner}"
    assert graphed.step_runner == "graph", graphed.step_runner
    assert graphed.graph.replays == len(batches) - WARMUP - 1  # the last, shorter batch ran eagerly
    for name, value in graphed.model.state_dict().items():
        assert close(value, eager.model.state_dict()[name]), name


@pytest.mark.parametrize("method", sorted(set(classifier_methods()) - set(CAPTURABLE)))
def test_a_step_that_cannot_be_replayed_runs_eagerly_on_the_gpu_and_says_why(trained, method):
    graphed, _ = pair(trained, method)  # cotta's augmentations draw random numbers: no eager twin to match
    for images in stream_of(trained[2]):
        assert torch.isfinite(graphed.step(images)).all()
    assert graphed.step_runner == f"eager: {method}'s step is not replayable as a CUDA graph"


def test_fp16_runs_eagerly_on_the_gpu_and_says_why(trained):
    graphed, _ = pair(trained, "tent", precision="fp16")
    graphed.step(trained[2][:40])
    assert graphed.step_runner == "eager: fp16's loss scale moves on the host"
