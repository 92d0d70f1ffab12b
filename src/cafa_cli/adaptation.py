"""Which parameters adapt, how normalisation layers see the test batch, and one
online step of each method (predict with the forward pass, then update)."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from cafa_cli import losses
from cafa_cli.distances import ClassDistances
from cafa_cli.errors import UsageError
from cafa_cli.models import FeatureClassifier, pick_device
from cafa_cli.statistics import ClassGaussians

METHODS = ("source", "bn", "pl", "tent", "cafa", "global-fa", "intra", "euclidean")
NEEDS_STATISTICS = ("cafa", "global-fa", "intra", "euclidean")
PARAM_SETS = ("norm", "all")
OPTIMIZERS = ("adam", "sgd", "nesterov")  # nesterov: SGD with Nesterov momentum, as TENT's reference code
NORM_LAYERS = (_BatchNorm, nn.LayerNorm, nn.GroupNorm)
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
OWNED = "_cafa_adapter_owned"  # set on a net by the Adapter that adapts it


def check_settings(
    method: str, params: str = "norm", optimizer: str = "adam", lr: float = 1e-3, momentum: float = 0.9,
    steps: int = 1, bn_prior: float = 0.0, precision: str = "fp32", device: torch.device = torch.device("cpu"),
) -> None:
    """The Adapter's option values, checked before any model or data is read."""
    numbers = {"--lr": lr, "--momentum": momentum, "--bn-prior": bn_prior}
    for option, value in numbers.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UsageError(f"{option} must be a number, not {value!r}")
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise UsageError(f"--steps must be a whole number, not {steps!r}")
    choices = {"--method": (method, METHODS), "--params": (params, PARAM_SETS), "--optimizer": (optimizer, OPTIMIZERS),
               "--precision": (precision, tuple(PRECISIONS))}
    for option, (value, allowed) in choices.items():
        if value not in allowed:
            raise UsageError(f"{option} must be one of {', '.join(allowed)}, not {value}")
    if PRECISIONS[precision] is not None and device.type != "cuda":
        raise UsageError(f"--precision {precision} is for CUDA; on the CPU use fp32")
    if steps < 1:
        raise UsageError(f"--steps must be at least 1, not {steps}")
    if not 0 < lr < math.inf:
        raise UsageError(f"--lr must be a positive number, not {lr}")
    if not 0 <= bn_prior < math.inf:
        raise UsageError(f"--bn-prior must be a number, 0 or more, not {bn_prior}")
    if not 0 <= momentum < 1:
        raise UsageError(f"--momentum must be in [0, 1), not {momentum}")
    if optimizer == "nesterov" and momentum == 0:
        raise UsageError("--optimizer nesterov needs a momentum above 0, not 0 (--momentum, or cafa.toml); for plain SGD use --optimizer sgd")


class BatchStatisticsNorm(nn.Module):
    """BatchNorm that normalises with the test batch's statistics.

    With `prior` = N > 0 the source running statistics count as N samples and are
    mixed with the batch's n (Schneider et al. 2020): μ = (N·μ_s + n·μ_t)/(N + n),
    likewise the variance — which makes batch size 1 usable.
    """

    def __init__(self, bn: _BatchNorm, prior: float = 0.0):
        super().__init__()
        self.weight, self.bias, self.eps = bn.weight, bn.bias, bn.eps
        self.prior = prior if bn.running_mean is not None else 0.0
        if bn.running_mean is not None:
            self.register_buffer("source_mean", bn.running_mean.detach().clone())
            self.register_buffer("source_var", bn.running_var.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == x.shape[1] and hasattr(self, "source_mean"):
            # one value per channel (one image, 1×1 maps) has no variance: the source statistics stand in
            return nn.functional.batch_norm(x, self.source_mean, self.source_var, self.weight, self.bias, training=False, eps=self.eps)
        if self.prior == 0:
            # the fused kernel: normalise by the batch's statistics, gradients through them
            return nn.functional.batch_norm(x, None, None, self.weight, self.bias, training=True, eps=self.eps)
        dims = [0] + list(range(2, x.dim()))
        # in float32 under autocast too, as the fused kernel keeps them: a bf16 mean has ~3
        # significant digits, and an fp16 variance overflows above 65504
        var, mean = torch.var_mean(x.float(), dims, unbiased=False)
        n = x.shape[0]
        mean = (self.prior * self.source_mean + n * mean) / (self.prior + n)
        var = (self.prior * self.source_var + n * var) / (self.prior + n)
        shape = [1, -1] + [1] * (x.dim() - 2)
        out = (x - mean.view(shape)) * (var.view(shape) + self.eps).rsqrt()
        if self.weight is not None:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out


def use_test_batch_norm(model: nn.Module, prior: float = 0.0) -> int:
    """Swap every BatchNorm (found by type, so those inside ResNet `downsample` too)
    for a BatchStatisticsNorm sharing its affine parameters. Returns how many were swapped."""
    swaps = [(name, module) for name, module in model.named_modules() if isinstance(module, _BatchNorm)]
    for name, module in swaps:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, BatchStatisticsNorm(module, prior))
    return len(swaps)


def select_parameters(model: FeatureClassifier, which: str = "norm") -> list[nn.Parameter]:
    """Freeze everything, then unfreeze the normalisation affines (`norm`) or the
    whole feature extractor (`all`, the paper's CAFA-Full). The classifier stays fixed."""
    model.requires_grad_(False)
    if which == "all":
        classifier = {id(p) for p in model.classifier.parameters()}
        chosen = [p for p in model.parameters() if id(p) not in classifier]
    else:
        chosen = []
        for module in model.modules():
            if isinstance(module, (BatchStatisticsNorm, *NORM_LAYERS)):
                chosen += [p for p in (module.weight, module.bias) if isinstance(p, nn.Parameter)]
    unique = list({id(p): p for p in chosen}.values())
    if not unique:
        what = "normalisation layers with affine parameters" if which == "norm" else "parameters before its classifier"
        raise UsageError(f"the model has no {what} to adapt; use --params all, or --method source or bn")
    for p in unique:
        p.requires_grad_(True)
    return unique


def make_objective(
    method: str, gaussians: ClassGaussians | None, device: torch.device
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """(logits, features) -> loss for a gradient method; None for source and bn."""
    if method in ("source", "bn"):
        return None
    if method == "tent":
        return lambda logits, features: losses.entropy(logits)
    if method == "pl":
        return lambda logits, features: losses.pseudo_label(logits)
    if gaussians is None:
        raise UsageError(f"--method {method} needs class statistics: pass --stats ARTIFACT (made by cafa stats; in Python, Adapter's gaussians)")
    if method == "global-fa":
        mean, covariance = gaussians.global_mean.to(device), gaussians.global_covariance.to(device)
        return lambda logits, features: losses.global_alignment(features, mean, covariance)
    distances = ClassDistances(gaussians, device, metric="euclidean" if method == "euclidean" else "mahalanobis")
    loss = losses.intra if method == "intra" else losses.cafa
    return lambda logits, features: loss(distances(features), logits.detach().argmax(1))


class Adapter:
    """A model adapting online: `step(images)` returns the logits of the forward pass
    that also computed the loss (the prediction is made before the update)."""

    def __init__(
        self,
        model: FeatureClassifier,
        method: str = "cafa",
        gaussians: ClassGaussians | None = None,
        device: torch.device | str | None = None,
        params: str = "norm",
        optimizer: str = "adam",
        lr: float = 1e-3,
        momentum: float = 0.9,
        steps: int = 1,
        bn_prior: float = 0.0,
        precision: str = "fp32",
        compile: bool = False,
    ):
        if getattr(model.model, OWNED, False) or any(isinstance(m, BatchStatisticsNorm) for m in model.modules()):
            # its BatchNorms may be swapped and its weights adapted: a second Adapter would
            # start from there, not from the source model, and reset() would return there
            raise UsageError("this model already belongs to an Adapter; give each Adapter its own copy of the source "
                             "model (copy.deepcopy before the first Adapter, or load it again)")
        if device is None:  # where the model is
            device = next((p.device for p in model.parameters()), torch.device("cpu"))
        # a torch.device of another kind (mps, xla) is the caller's choice; CUDA is checked to be there
        device = pick_device(device) if isinstance(device, str) or torch.device(device).type == "cuda" else torch.device(device)
        check_settings(method, params, optimizer, lr, momentum, steps, bn_prior, precision, device)
        if gaussians is not None and tuple(gaussians.means.shape) != (model.num_classes, model.feature_dim):
            C, d = gaussians.means.shape
            raise UsageError(
                f"the statistics are for {C} classes of {d}-dimensional features but the model has {model.num_classes} "
                f"outputs and {model.feature_dim}-dimensional features; compute them with this model"
            )
        self.objective = make_objective(method, gaussians, device)
        self.model, self.method, self.device, self.steps = model.to(device), method, device, steps
        # channels_last lets cuDNN pick its faster NHWC convolution kernels
        self.memory_format = torch.channels_last if device.type == "cuda" else torch.contiguous_format
        self.model.to(memory_format=self.memory_format)
        # Eval mode throughout: BatchStatisticsNorm uses the batch statistics regardless, and
        # dropout / stochastic depth would only add noise to the predictions.
        self.model.eval()
        self.batch_norms = use_test_batch_norm(self.model, bn_prior) if method != "source" else 0
        self.params = select_parameters(self.model, params) if self.objective else []
        if self.objective is None:
            self.model.requires_grad_(False)
        self._optimizer_kind, self._lr, self._momentum = optimizer, lr, momentum
        self.optimizer = self._new_optimizer()
        self.source_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.skipped_steps = 0
        self.autocast = _autocast(device, precision)
        # fp16 gradients underflow without loss scaling; bf16 has float32's range
        self._scaled = precision == "fp16"
        self.scaler = self._new_scaler()
        # torch.compile shares the module's parameters, so reset() and the optimiser
        # act on it unchanged; the first batches pay for the compilation
        self.forward = torch.compile(self.model) if compile else self.model
        setattr(model.model, OWNED, True)  # on the bare net: a second FeatureClassifier of it is the same model

    def _new_optimizer(self) -> torch.optim.Optimizer | None:
        if not self.params:
            return None
        if self._optimizer_kind in ("sgd", "nesterov"):
            return torch.optim.SGD(self.params, lr=self._lr, momentum=self._momentum, nesterov=self._optimizer_kind == "nesterov")
        return torch.optim.Adam(self.params, lr=self._lr)

    def _new_scaler(self) -> torch.amp.GradScaler | None:
        return torch.amp.GradScaler(self.device.type) if self._scaled and self.params else None

    def reset(self) -> None:
        """Back to the source weights, bit for bit, with a fresh optimiser state."""
        self.model.load_state_dict(self.source_state)
        self.optimizer = self._new_optimizer()
        self.scaler = self._new_scaler()

    def step(self, images: torch.Tensor) -> torch.Tensor:
        images = images.to(self.device, non_blocking=True)
        if images.dim() == 4:
            images = images.contiguous(memory_format=self.memory_format)
        if self.objective is None:
            with torch.no_grad(), self.autocast:  # not inference_mode: callers may change the logits in place
                logits, _ = self.forward(images)
            return logits.float()
        prediction = None
        # a caller's evaluation loop is often under no_grad or inference_mode; the update needs gradients
        with torch.inference_mode(False), torch.enable_grad():
            if images.is_inference():  # made under inference_mode: autograd cannot save it for the backward pass
                images = images.clone()
            for _ in range(self.steps):
                with self.autocast:
                    logits, features = self.forward(images)
                if prediction is None:
                    prediction = logits.detach().float()
                loss = self.objective(logits.float(), features.float())
                if not self._apply(loss):
                    break
        return prediction

    def _apply(self, loss: torch.Tensor) -> bool:
        """One optimiser step; a non-finite loss or gradient skips it (and is counted)
        so that NaN never reaches the weights. With fp16 the loss is scaled for the
        backward pass and the gradients unscaled before the check; an overflow also
        halves the scale for the next step."""
        self.optimizer.zero_grad(set_to_none=True)
        if not torch.isfinite(loss):
            self.skipped_steps += 1
            return False
        if self.scaler is None:
            loss.backward()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.optimizer)
        # one reduction on the device and one sync, not one per parameter (ResNet-50: 106)
        grads = [p.grad for p in self.params if p.grad is not None]
        finite = not grads or bool(torch.stack([g.isfinite().all() for g in grads]).all())
        if not finite:
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
        elif self.scaler is None:
            self.optimizer.step()
        else:
            self.scaler.step(self.optimizer)
        if self.scaler is not None:
            self.scaler.update()
        return finite


def _autocast(device: torch.device, precision: str):
    return nullcontext() if PRECISIONS[precision] is None else torch.autocast(device.type, dtype=PRECISIONS[precision])
