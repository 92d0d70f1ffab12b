"""SoTTA: screening out noisy samples (Gong et al., "SoTTA: Robust Test-Time Adaptation on
Noisy Data Streams", NeurIPS 2023), for streams that mix images from outside the label set
(outliers) into the test data.

Update rule. The model predicts with the BatchNorms' running statistics (the source's,
then as its steps move them). Each sample is offered to a memory of K (`memory_size`)
samples, high-confidence uniform-class sampling (HUS):

1. a sample whose confidence, the largest softmax probability p̂ of the prediction, is
   below `threshold` is dropped (the screening that keeps most outliers out);
2. otherwise it is stored with its predicted class c; when the memory is full, a stored
   sample is removed first: a random one of c's if c is among the classes holding the
   most samples, else a random one of a random class among those;

and after every `update_every` samples offered, one sharpness-aware step on the memory's
samples (in train mode: BatchNorms normalise with the memory's statistics and move their
running statistics toward them by `bn_momentum`, once for each of the step's two forward
passes), minimising the entropy averaged over samples and classes,
    L = (1/(M·C)) Σ_m Σ_c −p_mc log(p_mc + 1e-6),
with SAM (methods/shared/sam.py, ρ = `rho`) over the Adapter's optimiser. A memory of one
sample steps with the running statistics, as the authors' code does.

The authors' code (taeckyung/SoTTA learner/sotta.py, utils/memory.py HUS, tta.sh) offers
one sample at a time and predicts the `update_every` samples before each step together; here
a batch is predicted as it arrives, then offered sample by sample, the steps falling where
the count of samples offered says (with batch size = `update_every`, as in the recipes,
this is the authors' order). The parameters are the normalisation affines but the top block
(their sam_collect_params with freeze_top, `frozen`), dropout stays off. Their random
removals draw from Python's `random`; here from torch's generator, two uniforms for each
sample offered (shared/class_memory.py), used when a removal needs them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from cafa_cli.core.errors import InputError
from cafa_cli.engine.method import AdapterSurface, Method
from cafa_cli.engine.options import Option
from cafa_cli.methods.shared import class_memory
from cafa_cli.methods.shared.class_memory import ClassMemory, pick
from cafa_cli.methods.shared.memory_bank import CAPACITY, UPDATE_EVERY
from cafa_cli.methods.shared.running_norms import training_norms
from cafa_cli.methods.shared.sam import FROZEN_OPTION, ascend, descend_from, unfrozen_parameters
from cafa_cli.model.features import FeatureClassifier

THRESHOLD = 0.99  # the authors' CIFAR-10 confidence threshold
BN_MOMENTUM = 0.2
RHO = 0.05


def hloss(logits: torch.Tensor) -> torch.Tensor:
    """The authors' HLoss: −p log(p + 1e-6) averaged over samples and classes."""
    p = logits.softmax(1)
    return -(p * torch.log(p + 1e-6)).mean()


class SoTTA(Method):
    name = "sotta"
    owns_update = True
    draws_random_numbers = True  # the memory's random removals
    adapts_normalisation = False  # it predicts with the running statistics, which its own steps move
    running_norms = "it keeps the BatchNorms' running statistics itself, moved by its steps on the memory"
    options = (
        Option("memory_size", CAPACITY, "K, the samples the memory holds", "count", most=10_000),
        Option("update_every", UPDATE_EVERY, "a step on the memory after every this many samples", "count"),
        Option("threshold", THRESHOLD, "the confidence a sample needs to enter the memory", "fraction"),
        Option("bn_momentum", BN_MOMENTUM, "the BatchNorms' momentum in the steps on the memory", "fraction"),
        Option("rho", RHO, "ρ, the radius of the sharpness-aware perturbation", "positive"),
        FROZEN_OPTION,
    )

    def setup(self) -> None:
        self.saved: list[torch.Tensor] | None = None  # θ while the step is taken at θ + ε
        self.num_classes = 0
        self.reported: tuple | None = None  # the batch's logits and features, for its later `steps`
        self.fresh = False  # a new batch, not yet offered (the Adapter's `steps` call update again)
        self.reset()

    def reset(self) -> None:
        self.memory: ClassMemory | None = None  # made once the number of classes is known (attach)
        self.offered = 0  # samples offered since the last reset (a host count)
        if self.num_classes:
            self.memory = ClassMemory(self.num_classes, self.memory_size)

    def choose_parameters(self, model: FeatureClassifier, which: str = "norm") -> list[nn.Parameter]:
        return unfrozen_parameters(model, which, self.frozen, self.name)

    def attach(self, model: FeatureClassifier) -> None:
        for name, m in model.named_modules():
            if isinstance(m, _BatchNorm) and m.running_mean is None:
                raise InputError(
                    f"sotta needs the running statistics of every BatchNorm, and the one at {name} keeps none "
                    f"(track_running_stats=False); use a model trained with them, or another method"
                )
        self.num_classes = model.num_classes
        self.reset()

    def before_step(self, images: torch.Tensor) -> None:
        self.fresh = True

    def update(self, adapter: AdapterSurface, images: torch.Tensor, skipped: torch.Tensor | None):
        if not self.fresh:  # the Adapter's later `steps` on this batch: taken on the memory already
            return self.reported + (skipped,)
        self.fresh = False
        with torch.no_grad(), adapter.autocast:
            logits, features = adapter.forward(images)
        logits, features = logits.float(), features.float()
        self.reported = (logits, features)
        confidences, labels = logits.softmax(1).max(1)
        draws = class_memory.removal_draws(len(images), images.device)
        host = torch.cat([torch.stack([labels.double(), confidences.double()], 1), draws], 1).tolist()  # one transfer
        flag = skipped
        for n, (c, confidence, *u) in enumerate(host):
            if confidence >= self.threshold:
                self._store(images[n], int(c), u)
            self.offered += 1
            if self.offered % self.update_every == 0:
                flag = self._train(adapter, flag)
        return logits, features, flag

    def _store(self, sample: torch.Tensor, c: int, u: list[float]) -> None:
        """HUS's add_instance for a sample that passed the threshold: room made at random."""
        memory = self.memory
        counts = memory.counts()
        if sum(counts) >= self.memory_size:
            most = max(counts)
            largest = [k for k, count in enumerate(counts) if count == most]
            victim = c if c in largest else largest[pick(u[0], len(largest))]
            memory.remove(victim, pick(u[1], counts[victim]))
        memory.add(sample, c)

    def _train(self, adapter: AdapterSurface, flag: torch.Tensor | None) -> torch.Tensor | None:
        """`steps` sharpness-aware steps on the memory, by class then age, as HUS's get_memory."""
        samples = self.memory.samples()
        if samples is None:
            return flag
        if self.saved is None:
            self.saved = [torch.empty_like(p) for p in self.params]
        with training_norms(adapter.model, self.bn_momentum, on=len(samples) > 1):
            for _ in range(adapter.steps):
                with adapter.autocast:
                    first = hloss(adapter.forward(samples)[0].float())
                ascend(
                    self.params, first if adapter.scaler is None else adapter.scaler.scale(first), self.rho, self.saved
                )
                with adapter.autocast:
                    second = hloss(adapter.forward(samples)[0].float())
                flag = adapter.apply(second, flag, after_backward=descend_from(self.params, self.saved))
        return flag
