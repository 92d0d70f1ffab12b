"""Issue 63's methods (SPA included) through `cafa adapt` under every --order and every
--reset, on the tiny CNN and on a tiny timm ViT: each setting once a method, paired so that
four runs cover the three orders and the four resets (a full product would be twelve runs a
method for what the pairs already reach)."""

from __future__ import annotations

import pytest
from conftest import invoke
from helpers import adapt_args, rows
from test_cli_adapt import setup  # noqa: F401  (the module's trained net and artifact)

STREAMS = (
    ("iid", "domain"),
    ("label-shift:1.0", "episodic"),
    ("dirichlet:0.01", "never"),
    ("iid", "every:2"),
)
ON_ANY_MODEL = ("shot-im", "shot", "neo", "sotta", "stamp", "owttt", "spa", "tent:entropy=come")
ON_A_VIT = ("foa:population=2", "dpcore:source_margin=1")  # small enough for a 12-image source


def method_args(method: str) -> list[str]:
    """`name:option=value` is the method with one --method-option."""
    name, _, option = method.partition(":")
    return ["--method", name, *(["--method-option", option] if option else [])]


def stream_args(order: str, reset: str) -> list[str]:
    return ["--order", order, "--reset", reset]


@pytest.fixture(scope="module")
def vit_artifact(vit_run, tmp_path_factory):
    """The tiny ViT's class statistics (owttt's prototypes)."""
    artifact = tmp_path_factory.mktemp("vit-stats") / "s.safetensors"
    result = invoke("stats", *vit_run["model"], "--data", vit_run["source"], "--fraction", "1", "-o", artifact)
    assert result.exit_code == 0, result.stderr
    return artifact


@pytest.mark.parametrize("method", ON_ANY_MODEL)
def test_each_method_predicts_every_image_under_every_order_and_reset(setup, method):  # noqa: F811
    for order, reset in STREAMS:
        args = adapt_args(setup["test"], stats=setup["artifact"], batch_size=10, quiet=True)
        result = invoke(*args, *method_args(method), *stream_args(order, reset))
        assert result.exit_code == 0, (order, reset, result.stderr)
        predicted = rows(result)
        assert len(predicted) == 90 and len({row["path"] for row in predicted}) == 90, (order, reset)
        assert {row["prediction"] for row in predicted} <= {"a", "b", "c"}, (order, reset)


@pytest.mark.parametrize("method", ON_ANY_MODEL + ON_A_VIT)
def test_each_method_predicts_every_image_on_a_vit_under_every_order_and_reset(vit_run, vit_artifact, method):
    for order, reset in STREAMS:
        result = invoke(
            "adapt", *vit_run["model"], "--data", vit_run["data"], "--stats", vit_artifact, *method_args(method),
            "--source-data", vit_run["source"], "--batch-size", "3", "--quiet", *stream_args(order, reset),
        )  # fmt: skip
        assert result.exit_code == 0, (order, reset, result.stderr)
        predicted = rows(result)
        assert len(predicted) == 9 and len({row["path"] for row in predicted}) == 9, (order, reset)
