"""NEO and COME against float64 transcriptions of their authors' code, and both through `cafa adapt`.

NEO, transcribed from awesomealex1/NEO tta_library/neo.py (NEO.forward: the running mean of
every feature seen, the batch's own included, subtracted before the classifier) and
tta_library/neo_cont.py (NEO_Cont.forward: a moving mean, learning_rate 0.1). COME, from
BlueWhaleLab/COME: dirichlet_entropy (the same in tent_come.py, eata_come.py and
sar_come.py), tent_come.forward_and_adapt, eata_come.forward_and_adapt_eata and
sar_come.forward_and_adapt_sar_come, each with the SGD momentum 0.9 their main.py builds.
Their code hard-wires K = 1000, ImageNet's class count, as the opinion's uncertainty
numerator; with C classes it is C (the paper's subjective logic), so the transcription
takes K = C, and one test runs their code as written at C = 1000.

Our side runs the model in float64 too (the Adapter computes a loss in float32), so the
parameters are compared to ~1e-7.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import invoke
from helpers import adapt_args, rows
from test_cli_adapt import setup  # noqa: F401  (the module's trained net and artifact)
from test_fidelity import C, authors_model, batches, bn_affines, tiny
from torch import nn

from cafa_cli.core.errors import UsageError
from cafa_cli.engine.adapter import Adapter
from cafa_cli.methods import create
from cafa_cli.methods.recipes import shipped
from cafa_cli.methods.shared.losses import come_entropies
from cafa_cli.model.features import FeatureClassifier

LR, MOMENTUM = 0.01, 0.9  # COME's main.py: SGD momentum 0.9 (a rate that moves this tiny net visibly)


def dirichlet_entropy(x: torch.Tensor, K: int = C) -> torch.Tensor:
    """The authors' dirichlet_entropy, K their literal 1000 (here the class count)."""
    x = x / torch.norm(x, p=2, dim=-1, keepdim=True) * torch.norm(x, p=2, dim=-1, keepdim=True).detach()
    brief = torch.exp(x) / (torch.sum(torch.exp(x), dim=1, keepdim=True) + K)
    uncertainty = K / (torch.sum(torch.exp(x), dim=1, keepdim=True) + K)
    probability = torch.cat([brief, uncertainty], dim=1) + 1e-7
    return -(probability * torch.log(probability)).sum(1)


def assert_close(mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    for name, p in theirs.items():
        torch.testing.assert_close(mine[name].detach(), p.detach(), rtol=0, atol=1e-7, msg=name)


def ours(method: str, net: nn.Module, **options) -> Adapter:
    """Our Adapter on a float64 copy of `net`, SGD momentum 0.9 as COME's main.py."""
    model = FeatureClassifier(copy.deepcopy(net).double())
    return Adapter(model, create(method, None, "cpu", **options), optimizer="sgd", lr=LR, momentum=MOMENTUM)


def trained_params(adapter: Adapter) -> dict[str, torch.Tensor]:
    return dict(adapter.model.model.named_parameters())


# --- COME's entropy of opinion ------------------------------------------------------------


@pytest.mark.parametrize("classes, scale", [(10, 3.0), (10, 20.0), (1000, 4.0)])
def test_come_entropy_and_its_gradient_are_the_authors(classes, scale):
    """Values and gradients in float64, at C = 1000 their code exactly as written."""
    g = torch.Generator().manual_seed(classes)
    logits = (scale * torch.randn(16, classes, generator=g, dtype=torch.float64)).requires_grad_(True)
    theirs = logits.detach().clone().requires_grad_(True)
    weights = torch.rand(16, generator=g, dtype=torch.float64)
    mine_value, their_value = come_entropies(logits), dirichlet_entropy(theirs, classes)
    torch.testing.assert_close(mine_value, their_value, rtol=0, atol=1e-12)
    (mine_value * weights).sum().backward()
    (their_value * weights).sum().backward()
    torch.testing.assert_close(logits.grad, theirs.grad, rtol=0, atol=1e-12)
    # the bound on the norm: no gradient along the logits themselves
    torch.testing.assert_close((logits.grad * logits.detach()).sum(1), torch.zeros(16, dtype=torch.float64))


def test_come_entropy_is_finite_where_the_evidence_overflows():
    """exp(100) overflows float32; the softmax form does not (the authors' would give NaN)."""
    logits = torch.tensor([[100.0, 0.0, -3.0], [0.5, 0.2, 0.1]])
    assert dirichlet_entropy(logits, 3)[0].isnan()
    assert come_entropies(logits).isfinite().all()
    torch.testing.assert_close(come_entropies(logits)[1], dirichlet_entropy(logits, 3)[1])


# --- TENT, ETA and SAR with COME's entropy (tent_come.py, eata_come.py, sar_come.py) -------------


def tent_come_reference(net, xs):
    model = authors_model(net)
    params = bn_affines(model)  # collect_params: the BatchNorm affines
    for p in params.values():
        p.requires_grad_(True)
    optimizer = torch.optim.SGD(params.values(), LR, momentum=MOMENTUM)
    history = []
    for x in xs:
        outputs = model(x.double())
        loss = dirichlet_entropy(outputs).mean(0)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        history.append({k: p.detach().clone() for k, p in params.items()})
    return history


def test_tent_with_come_matches_the_authors_tent_come():
    net, xs = tiny(), batches(3)
    adapter = ours("tent", net, entropy="come")
    source = {k: p.detach().clone() for k, p in trained_params(adapter).items()}
    for x, expected in zip(xs, tent_come_reference(net, xs)):
        adapter.step(x.double())
        assert_close(trained_params(adapter), expected)
    assert not torch.equal(trained_params(adapter)["bn.weight"], source["bn.weight"])


def eata_come_reference(net, xs, e_margin, d_margin):
    """forward_and_adapt_eata of eata_come.py (no Fisher term: ETA), each batch in turn."""
    model = authors_model(net)
    params = bn_affines(model)
    for p in params.values():
        p.requires_grad_(True)
    optimizer = torch.optim.SGD(params.values(), LR, momentum=MOMENTUM)
    probs, history, kept = None, [], []
    for x in xs:
        outputs = model(x.double())
        entropys = dirichlet_entropy(outputs)
        filter_ids_1 = torch.where(entropys < e_margin)
        entropys = entropys[filter_ids_1]
        if probs is not None:
            cosine_similarities = F.cosine_similarity(probs.unsqueeze(0), outputs[filter_ids_1].softmax(1), dim=1)
            filter_ids_2 = torch.where(torch.abs(cosine_similarities) < d_margin)
            entropys = entropys[filter_ids_2]
            new = outputs[filter_ids_1][filter_ids_2].softmax(1)
        else:
            new = outputs[filter_ids_1].softmax(1)
        if probs is None:  # update_model_probs
            probs = new.mean(0).detach() if len(new) else None
        elif len(new):
            probs = 0.9 * probs + 0.1 * new.mean(0).detach()
        coeff = 1 / (torch.exp(entropys.clone().detach() - e_margin))
        loss = entropys.mul(coeff).mean(0)
        if len(entropys):
            loss.backward()
            optimizer.step()
        optimizer.zero_grad()
        kept.append(len(entropys))
        history.append({k: p.detach().clone() for k, p in params.items()})
    return history, kept


def test_eta_with_come_filters_weights_and_steps_as_the_authors_eata_come():
    net, xs = tiny(), batches(4)
    o = shipped("eta", "cifar10-c").options
    history, kept = eata_come_reference(net, xs, o["entropy_margin"] * math.log(C), o["redundancy_margin"])
    assert all(0 < k < 48 for k in kept), kept  # the filters keep some samples and drop some, each batch
    adapter = ours("eta", net, entropy="come", **o)
    for x, expected in zip(xs, history):
        adapter.step(x.double())
        assert_close(trained_params(adapter), expected)
    assert adapter.kept_samples == sum(kept)


def sar_come_reference(net, xs, margin, rho=0.05):
    """forward_and_adapt_sar_come with SAM's first and second steps (sam.py), each batch in turn."""
    model = authors_model(net)
    params = {  # collect_params skips layer4 (and ViT names this net has not)
        f"{nm}.{pn}": p
        for nm, m in model.named_modules()
        if isinstance(m, nn.BatchNorm2d) and "layer4" not in nm
        for pn, p in m.named_parameters()
    }
    for p in params.values():
        p.requires_grad_(True)
    base = torch.optim.SGD(params.values(), lr=LR, momentum=MOMENTUM)
    ema, history, kept = None, [], []
    for x in xs:
        entropys = dirichlet_entropy(model(x.double()))
        filter_ids_1 = torch.where(entropys < margin)
        entropys[filter_ids_1].mean(0).backward()
        norm = torch.norm(torch.stack([p.grad.norm(p=2) for p in params.values() if p.grad is not None]), p=2)
        olds = {k: p.detach().clone() for k, p in params.items()}
        with torch.no_grad():
            for p in params.values():
                p.add_(p.grad * (rho / (norm + 1e-12)))
        base.zero_grad()
        entropys2 = dirichlet_entropy(model(x.double()))[filter_ids_1]
        filter_ids_2 = torch.where(entropys2 < margin)
        loss_second = entropys2[filter_ids_2].mean(0)
        if not math.isnan(loss_second.item()):
            ema = loss_second.item() if ema is None else 0.9 * ema + 0.1 * loss_second.item()
        loss_second.backward()
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(olds[k])
        base.step()
        base.zero_grad()
        assert ema is None or ema >= 0.2  # no recovery in this short run
        kept.append(len(filter_ids_2[0]))
        history.append({k: p.detach().clone() for k, p in params.items()})
    return history, kept


def test_sar_with_come_steps_as_the_authors_sar_come():
    net, xs = tiny(), batches(3)
    o = shipped("sar", "cifar10-c").options
    history, kept = sar_come_reference(net, xs, o["entropy_margin"] * math.log(C), o["rho"])
    assert all(0 < k < 48 for k in kept), kept
    adapter = ours("sar", net, entropy="come", **o)
    for x, expected in zip(xs, history):
        adapter.step(x.double())
        assert_close(trained_params(adapter), expected)
    assert adapter.kept_samples == sum(kept)


def test_eata_with_come_takes_its_fisher_term_as_eta_takes_come():
    """EATA is ETA plus the Fisher term (tests/test_fidelity.py): with no source images the two
    are one update, with COME's entropy too."""
    net, xs = tiny(), batches(2)
    eata, eta = ours("eata", net, entropy="come"), ours("eta", net, entropy="come")
    for x in xs:
        torch.testing.assert_close(eata.step(x.double()), eta.step(x.double()), rtol=0, atol=0)


def test_a_state_saved_before_the_entropy_option_goes_on_at_shannon_and_not_at_come():
    net, x = tiny(), batches(1)[0]
    first = ours("tent", net)
    first.step(x.double())
    state = first.state_dict()
    del state["adaptation"]["option entropy"]  # as saved before tent had the option
    ours("tent", net).load_state_dict(state)
    with pytest.raises(UsageError, match="another adaptation: option entropy shannon \\(here come\\)"):
        ours("tent", net, entropy="come").load_state_dict(state)


# --- NEO (tta_library/neo.py, neo_cont.py) ------------------------------------------------


def neo_reference(net, xs, learning_rate: float | None = None) -> list[torch.Tensor]:
    """NEO.forward (learning_rate None) or NEO_Cont.forward, adapt=True, each batch in turn, in
    float64: the model in eval mode, its head the classifier of the centred features."""
    model = copy.deepcopy(net).double().eval()
    classifier, model.fc = model.fc, nn.Identity()  # get_vit_feature_extractor: the head made the identity
    count, centre, outputs = 0, torch.zeros(classifier.weight.shape[1], dtype=torch.float64), []
    with torch.no_grad():
        for x in xs:
            z = model(x.double())
            if learning_rate is None:
                count += z.size(0)
                centre = (count - z.size(0)) / count * centre + z.size(0) / count * torch.mean(z, dim=0)
            else:
                centre = (1 - learning_rate) * centre + learning_rate * torch.mean(z, dim=0)
            outputs.append(classifier(z - centre))
    return outputs


@pytest.mark.parametrize("options, learning_rate", [({}, None), ({"running_mean": "ema", "alpha": 0.1}, 0.1)])
def test_neo_predicts_the_authors_logits(options, learning_rate):
    """Batches of unequal sizes, so that the running mean weighs each by its count."""
    net = tiny()
    xs = [x[:n] for x, n in zip(batches(4), (48, 7, 30, 1))]
    expected = neo_reference(net, xs, learning_rate)
    # the method's own step in float64 (the Adapter hands a method float32 features)
    model = FeatureClassifier(copy.deepcopy(net).double().eval())
    neo = create("neo", None, "cpu", **options)
    neo.check(model, torch.device("cpu"))
    for x, want in zip(xs, expected):
        with torch.no_grad():
            logits, features = model(x.double())
            torch.testing.assert_close(neo.output(logits, features), want, rtol=0, atol=1e-12)
    # and through the Adapter, in float32
    adapter = Adapter(FeatureClassifier(copy.deepcopy(net)), create("neo", None, "cpu", **options))
    for x, want in zip(xs, expected):
        torch.testing.assert_close(adapter.step(x).double(), want, rtol=1e-5, atol=1e-5)
    assert adapter.optimizer is None and all(
        torch.equal(p, q) for p, q in zip(adapter.model.parameters(), net.parameters())
    )


def test_neo_goes_back_to_the_origin_on_reset_and_saves_its_centre():
    net, xs = tiny(), batches(2)
    adapter = Adapter(FeatureClassifier(copy.deepcopy(net)), create("neo"))
    first = adapter.step(xs[0])
    adapter.step(xs[1])
    state = adapter.state_dict()
    assert set(state["method_state"]) == {"centre", "seen"} and int(state["method_state"]["seen"]) == 96
    adapter.reset()
    torch.testing.assert_close(adapter.step(xs[0]), first, rtol=0, atol=0)
    again = Adapter(FeatureClassifier(copy.deepcopy(net)), create("neo"))
    again.load_state_dict(state)
    adapter.reset()
    adapter.step(xs[0])
    adapter.step(xs[1])
    torch.testing.assert_close(again.step(xs[0]), adapter.step(xs[0]), rtol=0, atol=0)


def test_neo_centres_the_classes_of_a_class_subset():
    """With a class subset the head is restricted to its outputs, as the authors' imagenet_mask."""
    net, x = tiny(), batches(1)[0]
    full = neo_reference(net, [x])[0]
    model = FeatureClassifier(copy.deepcopy(net))
    model.restrict_outputs([1, 4, 7])
    torch.testing.assert_close(Adapter(model, create("neo")).step(x).double(), full[:, [1, 4, 7]], rtol=1e-5, atol=1e-5)


# --- through the command line ---------------------------------------------------------------


@pytest.mark.parametrize(
    "method, option, order",
    [
        ("neo", "running_mean=all", "iid"),
        ("neo", "running_mean=all", "dirichlet:0.1"),
        ("neo", "running_mean=ema", "dirichlet:0.1"),
        ("tent", "entropy=come", "iid"),
        ("sar", "entropy=come", "dirichlet:0.1"),
    ],
)
def test_neo_and_come_run_through_cafa_adapt_on_any_order_without_resets(setup, method, option, order):  # noqa: F811
    result = invoke(
        *adapt_args(setup["test"], stats=setup["artifact"], batch_size=30, quiet=True),
        *("--method", method, "--method-option", option, "--order", order, "--reset", "never"),
    )
    assert result.exit_code == 0, result.stderr
    assert len(rows(result)) == 90
