"""The online Adapter: normalisation layers in test mode, the parameters a method trains,
reset to the source weights, and one step per batch (predict with the forward pass, then
update). It runs any method of methods/ through that protocol (methods/base.py)."""

from __future__ import annotations

from contextlib import nullcontext
import torch
from cafa_cli.errors import UsageError
from cafa_cli.method.features import FeatureClassifier
from cafa_cli.method.methods.base import Method, resolve_device
from cafa_cli.method.norms import BatchStatisticsNorm, use_test_batch_norm
from cafa_cli.method.options import check_adapter_options, check_precision


DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # autocast dtype of each precision


OWNED = "_cafa_adapter_owned"  # set on a net by the Adapter that adapts it


def check_settings(device: torch.device = torch.device("cpu"), **options) -> None:
    """The Adapter's keyword options, and the precision against the device it runs on."""
    check_adapter_options(**options)
    check_precision(options.get("precision", "fp32"), device.type)


class Adapter:
    """A model adapting online with `method` (methods.create(name, ...), or any Method):
    `step(images)` returns the logits of the forward pass that also computed the loss (the
    prediction is made before the update)."""

    def __init__(
        self,
        model: FeatureClassifier,
        method: Method,
        device: torch.device | str | None = None,
        *,
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
        if not isinstance(method, Method):
            raise UsageError(f"the Adapter takes a method object, not {method!r}: "
                             f"cafa_cli.method.methods.create(name, gaussians, device) makes one")
        if device is None:  # where the model is
            device = next((p.device for p in model.parameters()), torch.device("cpu"))
        device = resolve_device(device)
        check_settings(device, params=params, optimizer=optimizer, lr=lr, momentum=momentum, steps=steps, bn_prior=bn_prior,
                       precision=precision, compile=compile)
        method.check(model, device)
        self.model, self.method, self.device, self.steps = model.to(device), method, device, steps
        # channels_last lets cuDNN pick its faster NHWC convolution kernels
        self.memory_format = torch.channels_last if device.type == "cuda" else torch.contiguous_format
        self.model.to(memory_format=self.memory_format)
        # Eval mode throughout: BatchStatisticsNorm uses the batch statistics regardless, and
        # dropout / stochastic depth would only add noise to the predictions.
        self.model.eval()
        self.batch_norms = use_test_batch_norm(self.model, bn_prior) if method.adapts_normalisation else 0
        self.params = method.parameters(self.model, params) if method.trains else []
        if not method.trains:
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
        self.method.reset()

    def step(self, images: torch.Tensor) -> torch.Tensor:
        images = images.to(self.device, non_blocking=True)
        if images.dim() == 4:
            images = images.contiguous(memory_format=self.memory_format)
        self.method.before_step(images)
        prediction = self._update(images) if self.method.trains else self._predict(images)
        self.method.after_step(prediction)
        return prediction

    def _predict(self, images: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), self.autocast:  # not inference_mode: callers may change the logits in place
            logits, _ = self.forward(images)
        return logits.float()

    def _update(self, images: torch.Tensor) -> torch.Tensor:
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
                loss = self.method.loss(logits.float(), features.float())
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
    return nullcontext() if DTYPES[precision] is None else torch.autocast(device.type, dtype=DTYPES[precision])
