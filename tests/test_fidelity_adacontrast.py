"""AdaContrast under its recipes against a float64 transcription of the update as the benchmark
collection runs it online, written here from mariodoebler/test-time-adaptation
classification/methods/adacontrast.py (AdaMoCo.forward and update_memory, AdaContrast's
loss_calculation, forward_and_adapt, update_labels, configure_model; refine_predictions,
soft_k_nearest_neighbors, instance_loss, classification_loss, div) and utils/misc.py
(ema_update_model): the tiny net of test_fidelity.py, the same batches, the same initial queue
and the same views on both sides."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_fidelity import batches, tiny

from cafa_cli.engine.adapter import Adapter
from cafa_cli.methods import adacontrast as adacontrast_module
from cafa_cli.methods import create
from cafa_cli.methods.recipes import shipped
from cafa_cli.model.features import FeatureClassifier


def weak(x):  # fixed views in place of the random ones, the same on both sides
    return x.flip(3)


def query(x):
    return 0.8 * x + 0.1


def key(x):
    return x.flip(2) * 1.1 - 0.05


class StrongViews:
    """The method draws the query's view, then the key's: alternate between the two."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x, generator=None):
        self.calls += 1
        return query(x) if self.calls % 2 else key(x)


def features_of(model, x):  # BaseModel's encoder: everything before the classifier
    return model.layer4(model.layer3(F.relu(model.bn(model.conv(x))))).mean((2, 3))


def reference(net, xs, mem_feat, mem_labels, lr, o):
    """The collection's AdaContrast in float64: every weight and bias trains (configure_model,
    collect_params), BatchNorms in train mode (the batch's statistics; the student's two passes
    move its running statistics), SGD with Nesterov momentum and weight decay. Reported: the
    model on the test images after the step in eval mode, on those running statistics (its
    forward()); under `prediction` batch on the batch's statistics, as cafa did until issue 60."""
    model = copy.deepcopy(net).double().train()
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d) and o["prediction"] == "batch":
            m.track_running_stats, m.running_mean, m.running_var = False, None, None
    params = [p for m in model.modules() for n, p in m.named_parameters(recurse=False) if n in ("weight", "bias")]
    momentum_model = copy.deepcopy(model)
    momentum_model.requires_grad_(False)
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9, dampening=0.0, weight_decay=o["weight_decay"], nesterov=True)
    mem_feat, mem_labels = mem_feat.double().T.clone(), mem_labels.clone()  # AdaMoCo's [D, K] layout
    K, m, T = o["queue_size"], o["teacher_momentum"], o["temperature"]
    queue_ptr, first_samples = 0, 0
    bank_feats, bank_probs, bank_ptr = torch.zeros(0, 8, dtype=torch.float64), None, 0
    outs, all_labels = [], []
    for x in xs:
        x = x.double()
        images_w, images_q, images_k = weak(x), query(x), key(x)
        feats_w = features_of(model, images_w)
        logits_w = model.fc(feats_w)
        with torch.no_grad():
            if first_samples >= o["refine_after"]:  # soft_k_nearest_neighbors, cosine distance
                distances = 1 - F.normalize(feats_w, dim=1) @ F.normalize(bank_feats, dim=1).T
                idxs = distances.sort()[1][:, : o["num_neighbors"]]
                pseudo = bank_probs[idxs, :].mean(1).max(1)[1]
            else:
                pseudo = logits_w.softmax(1).argmax(1)
                first_samples += len(x)
        feats_q = features_of(model, images_q)
        logits_q = model.fc(feats_q)
        q = F.normalize(feats_q, dim=1)
        with torch.no_grad():  # ema_update_model(update_all=True), before the key's forward pass
            for pe, p in zip(momentum_model.parameters(), model.parameters()):
                pe.data = m * pe.data + (1 - m) * p.data
            k = F.normalize(features_of(momentum_model, images_k), dim=1)
        l_pos = torch.einsum("nc,nc->n", q, k).unsqueeze(-1)
        l_neg = torch.einsum("nc,ck->nk", q, mem_feat.clone().detach())
        logits_ins = torch.cat([l_pos, l_neg], 1) / T
        idxs_replace = torch.arange(queue_ptr, queue_ptr + len(x)) % K  # update_memory, before the loss
        mem_feat[:, idxs_replace] = k.T
        mem_labels[idxs_replace] = pseudo
        queue_ptr = (queue_ptr + len(x)) % K
        mask = torch.ones_like(logits_ins, dtype=torch.bool)
        mask[:, 1:] = pseudo.reshape(-1, 1) != mem_labels
        logits_ins = torch.where(mask, logits_ins, torch.tensor([float("-inf")], dtype=torch.float64))
        loss_ins = F.cross_entropy(logits_ins, torch.zeros(len(x), dtype=torch.long))
        loss_cls = F.cross_entropy(logits_q, pseudo)
        probs_mean = logits_q.softmax(1).mean(0)
        loss_div = -torch.sum(-probs_mean * torch.log(probs_mean + 1e-8))
        loss = o["alpha"] * loss_cls + o["beta"] * loss_ins + o["eta"] * loss_div
        loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():  # update_labels on the momentum model's weak-view outputs
            feats = features_of(momentum_model, images_w)
            probs = momentum_model.fc(feats).softmax(1)
            end = bank_ptr + len(feats)
            if bank_feats.shape[0] < K:
                bank_feats = torch.cat([bank_feats, feats])
                bank_probs = probs if bank_probs is None else torch.cat([bank_probs, probs])
            else:
                idxs = torch.arange(bank_ptr, end) % len(bank_feats)
                bank_feats[idxs, :], bank_probs[idxs, :] = feats, probs
            bank_ptr = end % len(bank_feats)
            outs.append(model.eval()(x))
            model.train()
        all_labels.append(pseudo)
    state = {
        "student": dict(model.named_parameters()),
        "teacher": dict(momentum_model.named_parameters()),
        "mem_feat": mem_feat.T,
        "mem_labels": mem_labels,
        "bank": (bank_feats, bank_probs, bank_ptr),
    }
    return outs, all_labels, state


# cifar10-c with a queue and bank of 64 and refinement after the first batch, so that three steps
# wrap the queue, grow the bank past it and vote among neighbours; imagenet-c as shipped (the
# refinement after 1,024 images then never comes in two steps); and a weight decay large enough to
# show in the weights (the recipes' 1e-4 at lr 2e-4 moves them by about 2e-8 a step)
SMALL = {"queue_size": 64, "refine_after": 48, "num_neighbors": 5}
CASES = {
    "cifar10-c": ("cifar10-c", SMALL, 3),
    "imagenet-c": ("imagenet-c", {}, 2),
    "weight decay": ("cifar10-c", {**SMALL, "weight_decay": 5.0}, 2),
    # the reported prediction on the batch's own statistics (until issue 60 the only one: logits
    # 0.46-0.50 from the collection's, argmax agreement 0-56 % on this net)
    "batch prediction": ("cifar10-c", {**SMALL, "prediction": "batch"}, 3),
}


def source_model():
    """The tiny net with source running statistics that are not a fresh BatchNorm's 0 and 1."""
    net = tiny(sharp=20.0)
    g = torch.Generator().manual_seed(4)
    for m in net.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.copy_(0.3 * torch.randn(m.num_features, generator=g))
            m.running_var.copy_(0.5 + torch.rand(m.num_features, generator=g))
    return net


def run(case: str, monkeypatch, **extra):
    monkeypatch.setattr(adacontrast_module, "weak_view", lambda x, generator=None: weak(x))
    monkeypatch.setattr(adacontrast_module, "strong_view", StrongViews())
    recipe, changes, n = CASES[case]
    net, xs = source_model(), batches(n)
    r = shipped("adacontrast", recipe)
    s = r.settings
    assert s["params"] == "all" and s["optimizer"] == "nesterov" and s["momentum"] == 0.9
    assert r.options["prediction"] == "running"
    o = {**r.options, **changes, **extra}
    torch.manual_seed(3)  # the queue's draw
    method = create("adacontrast", None, "cpu", **o)
    adapter = Adapter(FeatureClassifier(copy.deepcopy(net)), method, optimizer="nesterov", lr=s["lr"], params="all")
    return adapter, xs, o, s["lr"]


@pytest.mark.parametrize("case", list(CASES))
def test_adacontrast_under_its_recipe_steps_as_the_collection(case, monkeypatch):
    adapter, xs, o, lr = run(case, monkeypatch)
    method = adapter.method
    expected, labels, state = reference(source_model(), xs, method.keys, method.key_labels, lr, o)
    for x, want in zip(xs, expected):
        torch.testing.assert_close(adapter.step(x).double(), want, rtol=1e-4, atol=1e-5)
    if o["prediction"] == "running":  # what an exported model serves with: the eval statistics
        served = adapter.export()
        with torch.no_grad():
            torch.testing.assert_close(served(xs[-1]), adapter.features(xs[-1])[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(method.key_labels, state["mem_labels"], rtol=0, atol=0)
    torch.testing.assert_close(method.keys.double(), state["mem_feat"], rtol=1e-5, atol=1e-6)
    feats, probs, at = state["bank"]
    assert method.bank_at == at and method.seen == min(len(xs), -(-o["refine_after"] // 48)) * 48
    torch.testing.assert_close(method.bank_features.double(), feats, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(method.bank_probabilities.double(), probs, rtol=1e-5, atol=1e-6)
    mine = dict(adapter.model.model.named_parameters())
    assert set(mine) == set(state["student"])  # the classifier trains too
    for name, p in state["student"].items():
        torch.testing.assert_close(mine[name].detach().double(), p.detach(), rtol=1e-6, atol=1e-8, msg=name)
        # the steps moved every parameter: a wrong term shows in the weights, not only the outputs
        assert not torch.equal(mine[name].detach(), dict(source_model().named_parameters())[name].detach()), name
    teacher = dict(method.teacher.model.named_parameters())
    for name, p in state["teacher"].items():
        torch.testing.assert_close(teacher[name].double(), p, rtol=1e-6, atol=1e-8, msg=f"key encoder {name}")


def test_a_reset_draws_a_new_queue_and_empties_the_bank(monkeypatch):
    adapter, xs, _, _ = run("cifar10-c", monkeypatch)
    for x in xs:
        adapter.step(x)
    method = adapter.method
    before = method.keys.clone()
    adapter.reset()
    assert method.seen == 0 and method.key_at == 0 and method.bank_at == 0 and len(method.bank_features) == 0
    assert not torch.equal(method.keys, before) and torch.allclose(method.keys.norm(dim=1), torch.ones(64))
    student = adapter.model.state_dict()
    assert all(torch.equal(v, student[k]) for k, v in method.teacher.state_dict().items())


def test_the_views_are_a_function_of_the_generator():
    x = batches(1)[0]
    views = [adacontrast_module.strong_view(x, torch.Generator().manual_seed(5)) for _ in range(2)]
    assert views[0].shape == x.shape and torch.equal(views[0], views[1]) and not torch.equal(views[0], x)
    other = adacontrast_module.strong_view(x, torch.Generator().manual_seed(6))
    assert not torch.equal(views[0], other)
    flipped = adacontrast_module.weak_view(x, torch.Generator().manual_seed(5))
    assert all(torch.equal(v, x[i]) or torch.equal(v, x[i].flip(-1)) for i, v in enumerate(flipped))
    # a blur of the smallest σ leaves an image almost as it was; the greyscale view has equal channels
    sharp = adacontrast_module._blur(x, torch.full((len(x),), 0.1))
    torch.testing.assert_close(sharp, x, rtol=0, atol=1e-4)
