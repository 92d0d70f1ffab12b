"""RPL under its recipes against a float64 transcription of the benchmark collection's update
(mariodoebler/test-time-adaptation classification/methods/rpl.py: loss_calculation,
forward_and_adapt, configure_model, collect_params; utils/losses.py GeneralizedCrossEntropy;
engine/method.py setup_optimizer; cfgs/*/rpl.yaml), as tests/test_fidelity.py does for the
others: the same tiny net, BatchNorms on the batch's statistics, their affines trained, the
same batches, the parameters and the reported logits compared after each step."""

from __future__ import annotations

import pytest
import torch
from test_fidelity import assert_params_match, authors_model, batches, bn_affines, ours, tiny

from cafa_cli.methods.recipes import shipped


def rpl_reference(net, xs, optimizer: str, lr: float, q: float):
    model = authors_model(net)  # eval mode, BatchNorm2d without running statistics: the batch's
    params = bn_affines(model)
    for p in params.values():
        p.requires_grad_(True)
    if optimizer == "adam":  # setup_optimizer: betas (OPTIM.BETA 0.9, 0.999), WD 0
        opt = torch.optim.Adam(params.values(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    else:  # SGD with its defaults MOMENTUM 0.9, DAMPENING 0, NESTEROV True
        opt = torch.optim.SGD(params.values(), lr=lr, momentum=0.9, dampening=0.0, nesterov=True, weight_decay=0.0)
    outs, after = [], []
    for x in xs:
        outputs = model(x.double())
        labels = outputs.argmax(dim=1)
        probs = outputs.softmax(1)
        probs_with_correct_idx = probs.index_select(-1, labels).diag()
        loss = ((1.0 - probs_with_correct_idx**q) / q).mean(0)
        loss.backward()
        opt.step()
        opt.zero_grad()
        outs.append(outputs.detach())
        after.append({name: p.detach().clone() for name, p in params.items()})
    return outs, after


@pytest.mark.parametrize("recipe", ["cifar10-c", "imagenet-c"])
def test_rpl_under_its_recipe_matches_the_collections_update(recipe):
    r = shipped("rpl", recipe)
    s = r.settings
    assert r.options == {"q": 0.8} and s["params"] == "norm" and s.get("steps", 1) == 1
    assert (s["optimizer"], s["lr"]) == (("adam", 0.001) if recipe == "cifar10-c" else ("nesterov", 0.0005))
    net, xs = tiny(sharp=20.0), batches(3)
    adapter = ours(net, "rpl", recipe)
    expected, params = rpl_reference(net, xs, "adam" if s["optimizer"] == "adam" else "sgd", s["lr"], r.options["q"])
    for x, want, state in zip(xs, expected, params):
        got = adapter.step(x)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
        assert_params_match(adapter, state)
    # the step moved the affines: the comparison above is not of the source weights
    assert any(not torch.equal(p, q) for p, q in zip(params[-1].values(), bn_affines(authors_model(net)).values()))


def test_the_generalised_cross_entropy_tends_to_the_cross_entropy_as_q_goes_to_zero():
    from cafa_cli.methods.rpl import generalised_cross_entropy

    logits = torch.randn(6, 4, dtype=torch.float64) * 3
    labels = logits.argmax(1)
    ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    torch.testing.assert_close(generalised_cross_entropy(logits, labels, 1e-7), ce, rtol=1e-5, atol=1e-6)
    mae = 1 - logits.softmax(1).gather(1, labels[:, None]).squeeze(1)  # q = 1: 1 − p_ŷ
    torch.testing.assert_close(generalised_cross_entropy(logits, labels, 1.0), mae)
