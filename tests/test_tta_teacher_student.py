"""CoTTA and RoTTA (issue 20), each against an independent computation on a tiny case:
float64 forward passes and gradients written out from the papers' rules, and RoTTA's
memory bank as plain Python lists (as the official code keeps it)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from cafa_cli.core.errors import UsageError
from cafa_cli.engine.adapter import Adapter
from cafa_cli.methods import create
from cafa_cli.methods import rotta as rotta_module
from cafa_cli.methods.cotta import CoTTA
from cafa_cli.methods.rotta import RobustBatchNorm, RoTTA, on_samples
from cafa_cli.methods.shared.augment import augment
from cafa_cli.methods.shared.memory_bank import MemoryBank, timeliness_weights
from cafa_cli.model.features import FeatureClassifier


def tiny_net(seed: int = 0, classes: int = 3) -> FeatureClassifier:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, classes))
    with torch.no_grad():  # source statistics that differ from the test batches'
        net[1].running_mean.uniform_(-1, 1)
        net[1].running_var.uniform_(0.5, 2)
        net[3].weight.mul_(4)
    return FeatureClassifier(net)


def forward64(net: FeatureClassifier, x: torch.Tensor, weight, bias, mean=None, var=None) -> torch.Tensor:
    """The tiny net in float64 with the BN affine (weight, bias), normalising with (mean,
    var) or, when not given, the batch's biased statistics."""
    layers = net.model
    h = nn.functional.linear(x.double(), layers[0].weight.double(), layers[0].bias.double())
    if mean is None:
        var, mean = torch.var_mean(h, 0, unbiased=False)
    h = (h - mean) / torch.sqrt(var + layers[1].eps) * weight + bias
    return nn.functional.linear(h.relu(), layers[3].weight.double(), layers[3].bias.double())


def ce64(student: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return -(target.softmax(1) * student.log_softmax(1)).sum(1)


# --- CoTTA -------------------------------------------------------------------------------


def test_cotta_step_is_cross_entropy_to_the_teacher_then_the_teacher_follows():
    x = torch.randn(16, 3) * 2
    net = tiny_net()
    bn = net.model[1]
    w0, b0 = bn.weight.detach().double().clone(), bn.bias.detach().double().clone()
    lr, alpha = 0.5, 0.9
    method = CoTTA(teacher_momentum=alpha, restore_probability=0.0, confidence_threshold=0.0)  # never below: no views
    adapter = Adapter(copy.deepcopy(net), method, optimizer="sgd", momentum=0.0, lr=lr)
    reported = adapter.step(x)

    w, b = w0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
    teacher = forward64(net, x, w0, b0)  # the teacher starts as the source
    loss = ce64(forward64(net, x, w, b), teacher).mean()
    gw, gb = torch.autograd.grad(loss, [w, b])
    student_w, student_b = w0 - lr * gw, b0 - lr * gb
    torch.testing.assert_close(reported.double(), teacher, rtol=1e-5, atol=1e-6)  # the teacher's, before the update
    trained = adapter.model.model[1]
    torch.testing.assert_close(trained.weight.detach().double(), student_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(trained.bias.detach().double(), student_b, rtol=1e-5, atol=1e-6)
    followed = method.teacher.model[1]
    torch.testing.assert_close(followed.weight.double(), alpha * w0 + (1 - alpha) * student_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(followed.bias.double(), alpha * b0 + (1 - alpha) * student_b, rtol=1e-5, atol=1e-6)


def test_cotta_averages_the_teachers_logits_over_views_when_the_anchor_is_unsure():
    x = torch.randn(10, 3)
    net = tiny_net(1)
    reports = {}
    for threshold in (1.0, 0.0):  # a mean confidence is always below 1 and never below 0
        method = CoTTA(confidence_threshold=threshold, augmentations=4)
        adapter = Adapter(copy.deepcopy(net), method, lr=1e-3)
        torch.manual_seed(3)
        reports[threshold] = adapter.step(x)
    source = copy.deepcopy(adapter.method.anchor)
    torch.manual_seed(3)
    with torch.no_grad():
        views = torch.stack([source(augment(x))[0] for _ in range(4)]).double().mean(0)
        plain = source(x)[0].double()
    torch.testing.assert_close(reports[1.0].double(), views, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(reports[0.0].double(), plain, rtol=1e-5, atol=1e-6)


def conv_net(seed: int = 0, classes: int = 5) -> FeatureClassifier:
    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Conv2d(6, 8, 3, stride=2),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.BatchNorm1d(8),
        nn.Linear(8, classes),
    )
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d | nn.BatchNorm1d):
                m.weight.uniform_(0.5, 2)
                m.bias.uniform_(-1, 1)
    return FeatureClassifier(net)


def reference_augment(images: torch.Tensor) -> torch.Tensor:
    """augment as it was, one view a call: the draw order the batched views keep."""
    from cafa_cli.methods.shared import augment as a

    n, x = len(images), images.float()
    dims = tuple(range(2, x.dim())) or (1,)
    spread, mean = torch.std_mean(x, dim=dims, correction=0, keepdim=True)
    shape = (n,) + (1,) * (x.dim() - 1)
    contrast, brightness = a._uniform(n, a.CONTRAST, x).view(shape), a._uniform(n, a.BRIGHTNESS, x).view(shape)
    x = mean + contrast * (x - mean) + brightness * spread
    if x.dim() == 4 and x.shape[1] == 3:
        grey = x.mean(1, keepdim=True)
        x = grey + a._uniform(n, a.SATURATION, x).view(shape) * (x - grey)
    if x.dim() == 4:
        angle = a._uniform(n, (-a.DEGREES, a.DEGREES), x) * (math.pi / 180)
        scale = a._uniform(n, a.SCALE, x)
        shift = a._uniform(2 * n, (-a.TRANSLATE, a.TRANSLATE), x).view(n, 2) * 2
        flip = torch.where(torch.rand(n) < a.FLIP, -1.0, 1.0)
        theta = a._affine(angle, scale, shift, flip)
        x = nn.functional.grid_sample(
            x,
            nn.functional.affine_grid(theta, list(x.shape), align_corners=False),
            mode="bilinear",
            padding_mode="border",
            align_corners=False,
        )
    x = x + a.NOISE * spread * torch.randn_like(x)
    return x.to(images.dtype).contiguous(memory_format=a._memory_format(images))


@pytest.mark.parametrize(
    "shape, channels_last", [((5, 3, 12, 12), False), ((5, 3, 12, 12), True), ((4, 1, 9, 7), False), ((6, 7), False)]
)
def test_views_drawn_at_once_are_the_views_drawn_one_a_call(shape, channels_last):
    x = torch.randn(shape)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    torch.manual_seed(1)
    views = augment(x, 4)
    torch.manual_seed(1)
    one_a_call = torch.stack([reference_augment(x) for _ in range(4)], 1).flatten(
        0, 1
    )  # row n·4 + v: view v of image n
    assert torch.equal(views, one_a_call)
    assert views.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


@pytest.mark.parametrize(
    "norm, channels_last, per_pass",
    [("batch", False, 512), ("batch", False, 3), ("batch", True, 512), ("prior:8", False, 512), ("source", False, 512)],
)
def test_cotta_views_in_one_pass_are_the_views_one_pass_each(monkeypatch, norm, channels_last, per_pass):
    """The teacher's mean over views, several views a forward pass (each normalised with
    its own batch statistics), is the mean of one forward pass a view, within float
    tolerance (a convolution's kernel may depend on the batch size; here, on this CPU,
    the values came out identical except where a copy reorders the batch)."""
    from cafa_cli.methods import cotta as cotta_module

    monkeypatch.setattr(cotta_module, "VIEW_IMAGES", per_pass * 6)
    x = torch.randn(6, 3, 10, 10) * 2 + 1
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    method = CoTTA(augmentations=7)
    Adapter(conv_net(), method, norm=norm, lr=1e-3)
    assert cotta_module.groupable(method.teacher) == (norm != "prior:8")
    torch.testing.assert_close(*views_mean_batched_and_looped(method, x, views=7, seed=2), rtol=1e-5, atol=1e-6)
    assert all("forward" not in vars(m) for m in method.teacher.modules())  # the layers are themselves again


def views_mean_batched_and_looped(
    method: CoTTA, x: torch.Tensor, views: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's mean logits over `views` augmented views of x: CoTTA's one batched pass,
    and one pass a view, from the same random draws."""
    torch.manual_seed(seed)
    with torch.no_grad():
        batched = method.views_mean(x)
    torch.manual_seed(seed)
    with torch.no_grad():
        looped = sum(method.teacher(augment(x))[0].float() for _ in range(views)) / views
    return batched, looped


def test_a_one_image_view_of_one_value_per_channel_takes_the_source_statistics():
    method = CoTTA(augmentations=3)
    Adapter(conv_net(4), method, lr=1e-3)
    x = torch.randn(1, 3, 6, 6)
    torch.testing.assert_close(*views_mean_batched_and_looped(method, x, views=3, seed=0), rtol=1e-5, atol=1e-6)


def test_cotta_restores_each_element_to_the_source_with_probability_p():
    net = FeatureClassifier(nn.Sequential(nn.Linear(100, 100), nn.BatchNorm1d(100), nn.Linear(100, 3)))
    method = CoTTA(restore_probability=0.2)
    adapter = Adapter(net, method, params="all")
    with torch.no_grad():
        for p in adapter.params:
            p.add_(1.0)  # every element away from its source value
    torch.manual_seed(0)
    with torch.no_grad():
        method.restore()
    back = sum(int((p == s).sum()) for p, s in zip(adapter.params, method.anchor.parameters()))
    total = sum(p.numel() for p in adapter.params)
    assert total > 10_000 and adapter.params[-1].shape == (3,)  # `all`: the classifier too, as CoTTA's code
    assert abs(back / total - 0.2) < 4 * math.sqrt(0.2 * 0.8 / total)


def test_cotta_is_a_function_of_the_seed_and_reset_brings_the_teacher_back(trained):
    model, _, x, _ = trained
    runs = []
    for seed in (0, 0, 1):
        adapter = Adapter(copy.deepcopy(model), create("cotta", augmentations=2, confidence_threshold=1.0), lr=1e-2)
        torch.manual_seed(seed)
        runs.append(torch.cat([adapter.step(x[i : i + 50]) for i in range(0, 150, 50)]))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    adapter.reset()
    teacher = adapter.method.teacher.state_dict()
    assert all(torch.equal(v, teacher[k]) for k, v in adapter.method.anchor.state_dict().items())


def test_an_option_out_of_range_is_named():
    with pytest.raises(UsageError, match="cotta's option restore_probability must be a number in"):
        create("cotta", restore_probability=1.5)
    with pytest.raises(UsageError, match="rotta's option memory_size must be a whole number from 1 to 10,000"):
        create("rotta", memory_size=0)


# --- RoTTA -------------------------------------------------------------------------------


def test_robust_batch_norm_statistics_after_two_batches_match_float64():
    torch.manual_seed(4)
    bn = nn.BatchNorm2d(3)
    with torch.no_grad():
        (
            bn.running_mean.uniform_(-1, 1),
            bn.running_var.uniform_(0.5, 2),
            bn.weight.uniform_(0.5, 2),
            bn.bias.uniform_(-1, 1),
        )
    alpha = 0.05
    layer = RobustBatchNorm(bn, alpha)
    batches = [torch.randn(5, 3, 4, 4) * 3 + 1, torch.randn(6, 3, 4, 4) - 2]
    masks = [torch.ones(5), torch.tensor([1.0, 0, 1, 1, 0, 1])]  # the second with two empty slots
    mean, var = bn.running_mean.double(), bn.running_var.double()
    for x, mask in zip(batches, masks):
        layer.weights = mask
        out = layer(x)
        kept = x[mask.bool()].double()
        batch_var, batch_mean = torch.var_mean(kept, (0, 2, 3), unbiased=False)
        mean, var = (1 - alpha) * mean + alpha * batch_mean, (1 - alpha) * var + alpha * batch_var
    expected = (x.double() - mean.view(1, -1, 1, 1)) / torch.sqrt(var.view(1, -1, 1, 1) + bn.eps)
    expected = expected * bn.weight.double().view(1, -1, 1, 1) + bn.bias.double().view(1, -1, 1, 1)
    torch.testing.assert_close(layer.global_mean.double(), mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.global_var.double(), var, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.double(), expected.detach(), rtol=1e-5, atol=1e-5)
    layer.weights = None  # predicting: the global statistics as they are, unchanged
    torch.testing.assert_close(layer(x).double(), expected.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.global_mean.double(), mean, rtol=1e-5, atol=1e-6)


class ListBank:
    """CSTU as the paper and the official code state it: per-class lists, in arrival order;
    with `expiry`, any sample older than it is a candidate too (cafa-robust's memory_expiry)."""

    def __init__(self, capacity: int, classes: int, expiry: int = 0):
        self.K, self.C, self.expiry = capacity, classes, expiry
        self.lists: list[list[list]] = [[] for _ in range(classes)]  # [uncertainty, age, id]

    def score(self, age: int, u: float) -> float:
        return 1 / (1 + math.exp(-age / self.K)) + u / math.log(self.C)

    def add(self, c: int, u: float, ident: int) -> None:
        sizes = [len(items) for items in self.lists]
        if sizes[c] < self.K / self.C and sum(sizes) < self.K:
            enters = True
        else:
            if sizes[c] < self.K / self.C:
                pool = [k for k in range(self.C) if sizes[k] == max(sizes)]
            else:
                pool = [c]
            best = None
            for k in range(self.C):
                for i, (v, age, _) in enumerate(self.lists[k]):
                    if k not in pool and not (self.expiry and age > self.expiry):
                        continue
                    if best is None or self.score(age, v) >= best[0]:
                        best = (self.score(age, v), k, i)
            enters = best[0] > self.score(0, u)
            if enters:
                self.lists[best[1]].pop(best[2])
        if enters:
            self.lists[c].append([u, 0, ident])
        for items in self.lists:
            for item in items:
                item[1] += 1

    def content(self) -> list[tuple[int, int, int]]:
        return sorted((c, ident, age) for c, items in enumerate(self.lists) for _, age, ident in items)


@pytest.mark.parametrize("expiry", [0, 9])
@pytest.mark.parametrize("K, C", [(6, 3), (5, 3), (6, 4)])  # K/C whole or not: a full bank with a class below its share
def test_the_memory_bank_replaces_as_cstu_does(K, C, expiry):
    bank, reference = MemoryBank(C, K, expiry=expiry), ListBank(K, C, expiry)
    g = torch.Generator().manual_seed(5)
    # a correlated stream (long runs of one class), then classes drawn with skewed frequencies
    skewed = torch.multinomial(torch.tensor([0.5, 0.3, 0.15, 0.05][:C]), 150, replacement=True, generator=g).tolist()
    labels = [0] * 10 + [1] * 3 + [0] * 4 + [c % C for c in [2, 1, 0, 2, 2, 2, 1, 0, 1, 1, 2, 0]] + skewed
    over_quota = False
    for ident, c in enumerate(labels):
        u = float(torch.rand((), generator=g))
        bank.add(torch.full((1, 2), float(ident)), torch.tensor([c]), torch.tensor([u]), ident)
        reference.add(c, u, ident)
        filled = bank.occupied
        got = sorted(
            zip(
                bank.labels[filled].tolist(),
                bank.samples[filled][:, 0].long().tolist(),
                bank.age_counts[filled].tolist(),
            )
        )
        assert got == reference.content(), ident
        over_quota = over_quota or max(bank.class_counts) > math.ceil(K / C)
    assert int(bank.occupied.sum()) == K
    assert over_quota == bool(expiry)  # an expired sample gave way to a class past its share


class DeviceBank:
    """The bank as it was before the host bookkeeping: every sample decided on the device
    with torch.where, one sample at a time (the reference the batched bank must match bit for bit)."""

    def __init__(self, C: int, K: int, lambda_t: float = 1.0, lambda_u: float = 1.0):
        self.C, self.K, self.lambda_t, self.lambda_u, self.per_class = C, K, lambda_t, lambda_u, K / C
        self.slots = None

    def scores(self, ages, uncertainties):
        return self.lambda_t / (
            1 + torch.exp(-ages.double() / self.K)
        ) + self.lambda_u * uncertainties.double() / math.log(self.C)

    def add(self, sample, label, uncertainty, arrival):
        K = self.K
        if self.slots is None:
            self.slots = sample.new_zeros((K + 1, *sample.shape))
            self.labels = torch.full((K,), -1, dtype=torch.int64)
            self.uncertainties = torch.zeros(K, dtype=torch.float64)
            self.age_counts = torch.zeros(K, dtype=torch.int64)
            self.arrivals = torch.zeros(K, dtype=torch.int64)
        occupied = self.labels >= 0
        counts = ((self.labels.unsqueeze(1) == torch.arange(self.C)) & occupied.unsqueeze(1)).sum(0)
        own = counts.gather(0, label.view(1)).squeeze(0)
        room_in_class = own < self.per_class
        room = occupied.sum() < K
        majority = (counts == counts.max()).gather(0, self.labels.clamp_min(0))
        candidates = occupied & torch.where(room_in_class, majority, self.labels == label)
        scores = torch.where(candidates, self.scores(self.age_counts, self.uncertainties), -math.inf)
        best = scores.max()
        ties = candidates & (scores == best)
        victim = torch.where(ties, self.labels * (1 << 40) + self.arrivals, -1).argmax()
        new_score = self.scores(torch.zeros_like(self.age_counts[0]), uncertainty)
        replace = ~(room_in_class & room) & (best > new_score)
        enters = (room_in_class & room) | replace
        first_empty = (~occupied).int().argmax()
        slot = torch.where(replace, victim, first_empty)
        self.slots.index_copy_(0, torch.where(enters, slot, K).view(1), sample.unsqueeze(0))
        here = enters & (torch.arange(K) == slot)
        self.labels = torch.where(here, label, self.labels)
        self.uncertainties = torch.where(here, uncertainty.double(), self.uncertainties)
        self.arrivals = torch.where(here, arrival, self.arrivals)
        self.age_counts = torch.where(here, 0, self.age_counts) + (self.labels >= 0).long()


@pytest.mark.parametrize(
    "K, C, batch, every, lambda_t",
    [
        (64, 10, 16, 64, 1.0),
        (64, 10, 64, 64, 1.0),
        (10, 3, 7, 5, 1.0),
        (5, 3, 4, 0, 1.0),
        (12, 12, 9, 4, 1.0),
        (64, 1000, 32, 64, 1.0),
        (10, 3, 8, 8, 0.0),
        (64, 10, 16, 64, 0.0),
    ],
)
def test_the_batched_bank_keeps_what_the_device_bank_kept(K, C, batch, every, lambda_t):
    """Offered a batch at a time (decided on the host), the bank holds exactly what the
    per-sample device bank holds at every pause: labels, ages, samples, bit for bit; on a
    skewed stream with runs of one class, tied uncertainties and a NaN (λ_t = 0: ties of
    the score itself, which distinct ages otherwise rule out)."""
    g = torch.Generator().manual_seed(K * 1000 + C)
    bank, reference = MemoryBank(C, K, lambda_t), DeviceBank(C, K, lambda_t)
    arrival, offered = 0, 0
    for b in range(40):
        labels = torch.multinomial(torch.linspace(1, 0.05, C) ** 2, batch, replacement=True, generator=g)
        if b % 5 == 1:
            labels[:] = labels[0]  # a run of one class
        u = torch.rand(batch, generator=g) * math.log(C)
        if b % 3 == 0:
            u = (u * 4).round() / 4  # ties
        if b == 7:
            u[batch // 2] = float("nan")
        samples = torch.randn(batch, 3, 2, 2, generator=g)
        pauses = []
        for number in bank.offer(samples, labels, u, arrival, every):
            pauses.append(number)
        for n in range(batch):
            reference.add(samples[n], labels[n], u[n], arrival + n)
            offered += 1
            if every and offered % every == 0:
                assert offered in pauses
        arrival += batch
        R = len(bank.samples)  # the slots made so far: the rest are empty
        assert bank.filled <= R <= K and (reference.labels[R:] < 0).all(), b
        assert torch.equal(bank.labels, reference.labels[:R]), b
        assert torch.equal(bank.age_counts, reference.age_counts[:R]), b
        assert torch.equal(bank.samples, reference.slots[:R]), b
        assert bank.ages.dtype == torch.float32 and torch.equal(bank.occupied, reference.labels[:R] >= 0)
    assert bank.filled == int((reference.labels >= 0).sum())


def test_the_pauses_show_the_bank_as_the_paused_at_sample_left_it():
    """A training step within a batch sees the bank after exactly the samples before it."""
    g = torch.Generator().manual_seed(2)
    labels, u = torch.randint(0, 3, (11,), generator=g), torch.rand(11, generator=g)
    samples = torch.randn(11, 2, generator=g)
    bank, reference = MemoryBank(3, 5), DeviceBank(3, 5)
    seen, done = [], 0
    for number in bank.offer(samples, labels, u, 1, every=4):  # samples 2..12: pauses after 4, 8 and 12
        seen.append(number)
        for n in range(done, number - 1):  # the reference up to the paused-at sample
            reference.add(samples[n], labels[n], u[n], 1 + n)
        done = number - 1
        R = len(bank.samples)
        assert (reference.labels[R:] < 0).all() and torch.equal(bank.labels, reference.labels[:R])
        assert torch.equal(bank.age_counts, reference.age_counts[:R]) and torch.equal(bank.samples, reference.slots[:R])
    assert seen == [4, 8, 12]


@pytest.mark.parametrize("K", [5, 64, 100])
def test_the_timeliness_table_is_what_the_device_computes_in_place(K):
    """The host reads the timeliness term from a table made once on the device; it is the
    value the scores of a [K] slot tensor hold, for any age (saturated past 40·K)."""
    bank = MemoryBank(10, K)
    bank.add(torch.zeros(1, 2), torch.tensor([0]), torch.tensor([0.0]), 0)
    ages = torch.randint(0, 60 * K, (50, K))
    for row in ages:
        expected = bank.scores(row, torch.zeros(K)).tolist()
        assert [bank.timeliness[min(a, len(bank.timeliness) - 1)] for a in row.tolist()] == expected
    assert bank.timeliness[-1] == 1.0 and bank.timeliness[0] == 0.5


def test_the_memory_bank_balances_the_classes_of_a_skewed_stream():
    bank = MemoryBank(3, 6)
    for ident, c in enumerate([0] * 20 + [1, 2] * 4):  # a long run of class 0, then the others
        bank.add(torch.zeros(1, 2), torch.tensor([c]), torch.tensor([0.5]), ident)
    counts = [int((bank.labels == c).sum()) for c in range(3)]
    assert counts == [2, 2, 2]  # K/C each: class 0 kept only its share


def test_the_first_run_of_one_class_fills_only_its_share():
    bank = MemoryBank(3, 6)
    for ident in range(10):  # ten samples of class 0, certain ones (u = 0): old ones are replaced
        bank.add(torch.zeros(1, 2), torch.tensor([0]), torch.tensor([0.0]), ident)
    assert int(bank.occupied.sum()) == 2  # K/C = 2 for class 0
    assert sorted(bank.age_counts[bank.occupied].tolist()) == [1, 2]  # the newest two, as each old one scores higher


@pytest.mark.parametrize("name", ["rotta", "cafa-robust"])
def test_a_step_on_the_bank_costs_what_it_stores_not_the_banks_size(trained, name):
    """memory_size 10,000 and eight images: every forward pass of a step on the bank (teacher,
    student) sees the eight slots made for them, and the bank holds no more (issue 60: 10,000
    slots, empty ones included, went through both networks)."""
    model, gaussians, x, _ = trained
    method = create(name, gaussians if name == "cafa-robust" else None, "cpu", memory_size=10_000, update_every=4)
    adapter = Adapter(copy.deepcopy(model), method, "cpu", lr=1e-3)
    seen = []
    for net in {id(n): n for n in (adapter.model, getattr(method, "teacher", None)) if n is not None}.values():
        net.model.register_forward_pre_hook(lambda _, inputs: seen.append(len(inputs[0])))
    adapter.step(x[:8])
    assert method.bank.filled == 8 and next(iter(adapter.optimizer.state.values()))["step"] == 2
    assert seen and max(seen) == 8 and len(method.bank.samples) == 8, seen
    for start in (8, 9, 10):  # one image at a time: the slots double as the stored images outgrow them
        adapter.step(x[start : start + 1])
    assert method.bank.filled == 11 and len(method.bank.samples) == 16


def test_timeliness_weights_are_exp_minus_age_over_one_plus_it():
    ages = torch.tensor([0.0, 1.0, 64 / 64, 2.5])
    expected = [0.5, 1 / (1 + math.e), 1 / (1 + math.e), math.exp(-2.5) / (1 + math.exp(-2.5))]
    assert timeliness_weights(ages).tolist() == pytest.approx(expected, rel=1e-6)


def test_rotta_reports_the_teachers_prediction_with_the_source_statistics_first():
    x = torch.randn(8, 3) * 2
    net = tiny_net(2)
    expected = copy.deepcopy(net).eval()(x)[0]  # the source model in eval mode: its running statistics
    adapter = Adapter(copy.deepcopy(net), create("rotta"), lr=1e-3)
    torch.testing.assert_close(adapter.step(x), expected.detach())


def test_rotta_trains_every_update_every_samples_over_the_stream():
    x = torch.randn(150, 3)
    adapter = Adapter(tiny_net(3), create("rotta", update_every=64), lr=1e-3)
    steps = []
    for i in range(0, 150, 50):
        adapter.step(x[i : i + 50])
        steps.append(int(next(iter(adapter.optimizer.state.values()))["step"]))
    assert steps == [0, 1, 2]  # after 50, 100 and 150 samples: the steps at 64 and 128
    adapter.reset()
    assert adapter.method.offered == 0 and adapter.method.bank.slots is None


def test_a_rotta_step_on_the_bank_matches_float64(monkeypatch):
    """The loss (time-aware weights, soft cross-entropy to the teacher, RBN statistics over
    the filled slots), the SGD step and the teacher's average, from the bank's state."""
    monkeypatch.setattr(rotta_module, "augment", lambda images: images)  # the strong view as the weak one
    torch.manual_seed(6)
    x = torch.randn(5, 3) * 2
    net = tiny_net(6)
    bn = net.model[1]
    w0, b0 = bn.weight.detach().double().clone(), bn.bias.detach().double().clone()
    mean0, var0 = bn.running_mean.double(), bn.running_var.double()
    lr, nu, alpha = 0.5, 0.01, 0.05
    method = RoTTA(memory_size=4, update_every=5, teacher_momentum=1 - nu)
    adapter = Adapter(copy.deepcopy(net), method, optimizer="sgd", momentum=0.0, lr=lr)
    bank = method.bank
    adapter.step(x)  # five offered: one step on the bank after the fifth

    filled = bank.occupied
    samples, ages = bank.samples[filled].double(), bank.ages[filled].double()
    assert 0 < len(samples) <= 4
    h = nn.functional.linear(samples, net.model[0].weight.double(), net.model[0].bias.double())
    batch_var, batch_mean = torch.var_mean(h, 0, unbiased=False)
    mean, var = (1 - alpha) * mean0 + alpha * batch_mean, (1 - alpha) * var0 + alpha * batch_var
    w, b = w0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
    teacher = forward64(net, samples, w0, b0, mean, var)  # teacher and student are both the source here
    weights = torch.exp(-ages) / (1 + torch.exp(-ages))
    loss = (ce64(forward64(net, samples, w, b, mean, var), teacher) * weights).mean()
    gw, gb = torch.autograd.grad(loss, [w, b])
    student = adapter.model.model[1]
    torch.testing.assert_close(student.weight.detach().double(), w0 - lr * gw, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(student.bias.detach().double(), b0 - lr * gb, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(student.global_mean.double(), mean, rtol=1e-5, atol=1e-6)
    followed = method.teacher.model[1]
    torch.testing.assert_close(followed.weight.double(), (1 - nu) * w0 + nu * (w0 - lr * gw), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        followed.global_var.double(), var, rtol=1e-5, atol=1e-6
    )  # the teacher's own RBN moved too


def test_empty_slots_do_not_change_the_statistics():
    bn = nn.BatchNorm1d(2)
    layer = RobustBatchNorm(bn, 0.5)
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [100.0, -100.0]])
    model = nn.Sequential(layer)
    with on_samples(model, torch.tensor([1.0, 1.0, 0.0])):
        model(x)
    assert layer.global_mean.tolist() == [1.0, 1.5]  # 0.5·0 + 0.5·(mean of the two filled rows)
    assert layer.weights is None
