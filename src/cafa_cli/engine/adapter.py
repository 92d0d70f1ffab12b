"""The online Adapter: normalisation layers in test mode, the parameters a method trains,
reset to the source weights, and one step per batch (predict with the forward pass, then
update). It runs any method of methods/ through that protocol (engine/method.py).

A step never waits for the device: a GPU runs ahead while the host queues the next
batch's kernels. So an update that a non-finite loss or gradient must skip is still
computed, and then left out on the device, as torch.amp's found-inf flag does: on CUDA
torch's fused Adam and SGD take the flag and leave the parameters and their state
(moments, momentum, Adam's step count) as they were; elsewhere the step runs as usual
and `torch.where` puts back the parameters and state saved before it, bit for bit. The
skipped updates are counted on the device and read only when `skipped_steps` is.

With `cuda_graph` on CUDA, the steady-state step is captured as one CUDA graph and
replayed (step_graph.py) where that is safe: a method that says its step is replayable
(`Method.capturable`; every `norm` keeps its statistics in place), fp32 or bf16, not
`compile` (torch.compile has graphs of its own), no oracle labels. It is on by default since
its first measurement on a GPU: steps 1.0-1.6x faster on an H200, every replayable method
captured there (issue 45; docs/performance/cuda-graph.md)."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from cafa_cli.core.errors import UsageError
from cafa_cli.engine.class_balanced import balance_histogram, class_balanced_norms, use_class_balanced_norms
from cafa_cli.engine.method import Method, resolve_device
from cafa_cli.engine.norms import BatchStatisticsNorm, norm_layers, use_test_batch_norm
from cafa_cli.engine.optimiser import check_weights_precision, guarded_step, new_optimizer
from cafa_cli.engine.options import AdapterSettings, check_precision
from cafa_cli.engine.serving import OWNED, Deployable
from cafa_cli.engine.state import tensors_sha256
from cafa_cli.engine.step_graph import StepGraph, kept_state
from cafa_cli.model.features import FeatureClassifier

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # autocast dtype of each precision
WRITTEN = ("model.", "optimizer.")  # _kept_state's tensors that the optimiser's fused kernels write (step_graph.py)


class Adapter(Deployable):
    """A model adapting online with `method` (methods.create(name, ...), or any Method):
    `step(images)` returns the logits of the forward pass that also computed the loss (the
    prediction is made before the update; with `steps` > 1, before the batch's last update).
    `settings` are the keywords of AdapterSettings (engine/options.py: params, optimizer, lr,
    momentum, steps, norm, precision, compile, cuda_graph), each checked, held as `self.settings`;
    an AdapterSettings unpacks into them (`**settings`). `norm` says which statistics the
    BatchNorms normalise with (norms.py); `class_moments`, {BatchNorm name: (means, variances)
    [C, channels]} of the source classes (an artifact's `norm_moments`), is for `class-balanced`."""

    def __init__(
        self,
        model: FeatureClassifier,
        method: Method,
        device: torch.device | str | None = None,
        *,
        class_moments: dict | None = None,
        **settings,
    ):
        self._one_thread_only()
        if not isinstance(model, FeatureClassifier):
            raise UsageError(
                f"the Adapter takes a FeatureClassifier, not a bare {type(model).__name__}: wrap the network, "
                f"FeatureClassifier(net) (cafa_cli.model.features), which finds its classifier layer"
            )
        if getattr(model.model, OWNED, False) or any(isinstance(m, BatchStatisticsNorm) for m in model.modules()):
            # its BatchNorms may be swapped and its weights adapted: a second Adapter would
            # start from there, not from the source model, and reset() would return there
            raise UsageError(
                "this model already belongs to an Adapter; give each Adapter its own copy of the source "
                "model (copy.deepcopy before the first Adapter, or load it again)"
            )
        if not isinstance(method, Method):
            raise UsageError(
                f"the Adapter takes a method object, not {method!r}: "
                f"cafa_cli.methods.create(name, gaussians, device) makes one"
            )
        if device is None:  # where the model is
            device = next((p.device for p in model.parameters()), torch.device("cpu"))
        device = resolve_device(device)
        self.settings = settings = AdapterSettings(**settings)
        check_precision(settings.precision, device.type)
        method.check(model, device)
        norm = settings.norm
        if norm.running and method.running_norms is not True:
            raise UsageError(
                f"`norm` {norm} keeps statistics from batch to batch, which {method.name or type(method).__name__} "
                f"cannot ({method.running_norms}); use `norm` batch, prior:N, alpha:A or source"
            )
        self.model, self.method, self.device, self.steps = model.to(device), method, device, settings.steps
        # channels_last lets cuDNN pick its faster NHWC convolution kernels
        self.memory_format = torch.channels_last if device.type == "cuda" else torch.contiguous_format
        self.model.to(memory_format=self.memory_format)
        # Eval mode throughout: BatchStatisticsNorm uses the batch statistics regardless, and
        # dropout / stochastic depth would only add noise to the predictions.
        self.model.eval()
        if not method.adapts_normalisation:
            self.batch_norms = 0
        elif norm.class_balanced:
            self.batch_norms = use_class_balanced_norms(self.model.model, class_moments)
        else:
            self.batch_norms = use_test_batch_norm(self.model.model, norm)
        self.norms = norm_layers(self.model)  # the swapped ones
        self.balanced = class_balanced_norms(self.model)  # None unless `norm` is class-balanced
        self.params = method.parameters(self.model, settings.params) if method.trains else []
        check_weights_precision(self.params, settings.optimizer)
        if not method.trains:
            self.model.requires_grad_(False)
        # CUDA: torch's fused optimisers leave out an update on a device flag themselves; on
        # the CPU fused Adam rounds differently from the default one, so the update is undone instead
        self._fused = device.type == "cuda"
        self.optimizer = self._new_optimizer()
        self.source_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self._skipped = torch.zeros((), dtype=torch.int64, device=device)  # skipped updates, counted on the device
        self.autocast = _autocast(device, settings.precision)
        # fp16 gradients underflow without loss scaling; bf16 has float32's range
        self._scaled = settings.precision == "fp16"
        self.scaler = self._new_scaler()
        # torch.compile shares the module's parameters, so reset() and the optimiser act on
        # it unchanged; the first batches pay for the compilation. A method that trains has
        # its forward pass and loss compiled together, so torch.compile's own backward graph
        # covers the loss too; the step is then three graphs: forward and loss, backward,
        # and the few kernels of the optimiser's step (torch breaks graphs at backward() and
        # around optimiser steps by design, pytorch/pytorch#104053)
        self.forward = torch.compile(self.model) if settings.compile and not method.trains else self.model
        self._forward_and_loss = torch.compile(self._forward_loss) if settings.compile else self._forward_loss
        self.graph, self._graph_off = None, self._why_no_graph(settings)
        if self._graph_off is None:
            self.graph = StepGraph(self._eager_step, self._kept_state, device, written=WRITTEN)
        setattr(model.model, OWNED, True)  # on the bare net: a second FeatureClassifier of it is the same model
        self._class_moments_sha256 = "none" if class_moments is None else tensors_sha256(class_moments)
        self._made_from: dict | None = None  # the sha256 of the source weights and inputs (serving.py's adaptation)

    def adapted(self) -> dict:
        """What the updates change: the number of tensors and of values, and the layer
        types they belong to ({"BatchNorm2d": tensors, ...}, most first); `batch_norms`, the
        BatchNorm layers normalising with test-batch statistics. Read from shapes only: no
        wait for the device."""
        trained = {id(p) for p in self.params}
        layers: dict[str, int] = {}
        for module in self.model.modules():
            own = sum(id(p) in trained for p in module.parameters(recurse=False))
            if own:
                kind = getattr(module, "source_type", type(module).__name__)
                layers[kind] = layers.get(kind, 0) + own
        return {
            "tensors": len(self.params),
            "parameters": sum(p.numel() for p in self.params),
            "layers": dict(sorted(layers.items(), key=lambda item: -item[1])),
            "batch_norms": self.batch_norms,
        }

    @property
    def skipped_steps(self) -> int:
        """Updates skipped because the loss or a gradient was not finite, since the Adapter
        was made (reset() keeps the count). Reading it waits for the device."""
        return int(self._skipped)

    @property
    def unrefined_batches(self) -> int:
        """Batches whose loss the method computed less exactly than usual (cafa: more classes
        at risk of float32 rounding than distances.refine_capacity). Reading it waits for the device."""
        return 0 if self.method.unrefined is None else int(self.method.unrefined)

    @property
    def undefined_batches(self) -> int:
        """Batches whose update the method left out because it is undefined there
        (Method.undefined_when). Reading it waits for the device."""
        return 0 if self.method.undefined is None else int(self.method.undefined)

    @property
    def kept_samples(self) -> int | None:
        """Samples the method's filter kept for its updates since the Adapter was made (EATA,
        SAR: methods that set `filters_samples`); None for the others. Reading it waits for the device."""
        if not self.method.filters_samples:
            return None
        return 0 if self.method.kept is None else int(self.method.kept)

    @property
    def domain_changes(self) -> int | None:
        """Changes of domain the method's detector saw since the Adapter was made (cafa-robust
        with `change_threshold`); None for a method without one."""
        return self.method.domain_changes

    @property
    def source_restarts(self) -> int | None:
        """Of those changes, the ones at which the method put the source's weights back
        (cafa-robust's `restart_weights` source, or fitter when the source's fit better); None
        for a method without a detector."""
        return self.method.source_restarts

    @property
    def step_runner(self) -> str:
        """What runs the steps: `graph` (a checked CUDA graph, replayed), or `eager: why`."""
        if self.graph is None:
            return f"eager: {self._graph_off}"
        return self.graph.status

    def _why_no_graph(self, settings: AdapterSettings) -> str | None:
        """Why this Adapter's steps cannot be a CUDA graph with `settings`, or None when they can (module docstring)."""
        method = self.method.name or type(self.method).__name__
        reasons = [
            (not settings.cuda_graph, "cuda_graph is off"),
            (self.device.type != "cuda", f"CUDA graphs need CUDA, not {self.device.type}"),
            (not self.method.capturable, f"{method}'s step is not replayable as a CUDA graph"),
            (settings.precision == "fp16", "fp16's loss scale moves on the host"),
            (settings.compile, "torch.compile makes its own graphs"),
        ]
        return next((reason for refused, reason in reasons if refused), None)

    def _kept_state(self) -> dict:
        """What a step may change or read from one batch to the next (step_graph.py checks it stays in place)."""
        optimizer = self.optimizer
        roots = {
            "model": self.model.state_dict(keep_vars=True),
            "skipped": self._skipped,
            "method": self.method,
            "norms": [{k: v for k, v in vars(layer).items() if not k.startswith("_")} for layer in self.norms],
        }
        if optimizer is not None:
            roots["optimizer"] = [optimizer.state.get(p, {}) for p in self.params]
            roots["settings"] = [
                {k: v for k, v in group.items() if k not in ("params", "capturable")}
                for group in optimizer.param_groups
            ]
        return kept_state(roots, skip=Method.per_batch)

    def _new_optimizer(self) -> torch.optim.Optimizer | None:
        settings = self.settings
        return new_optimizer(self.params, settings.optimizer, settings.lr, settings.momentum, self._fused)

    def _new_scaler(self) -> torch.amp.GradScaler | None:
        return torch.amp.GradScaler(self.device.type) if self._scaled and self.params else None

    def reset(self) -> None:
        """Back to the source weights, bit for bit, with a fresh optimiser state."""
        with self._one_thread():
            self.model.load_state_dict(self.source_state)
            self.optimizer = self._new_optimizer()
            self.scaler = self._new_scaler()
            if self.balanced is not None:
                self.balanced.start()
            self.method.reset()
            if self.graph is not None:  # its optimiser state and the method's are new tensors
                self.graph.drop()

    def step(self, images: torch.Tensor) -> torch.Tensor:
        with self._one_thread():
            images = self._batch(images)
            if self.graph is None:
                return self._eager_step(images)
            if self.method.oracle_labels is not None:  # the true labels, new each batch, are no input of the graph
                self.graph.off = "oracle labels change every batch"
            return self.graph(images)

    def _batch(self, images: torch.Tensor) -> torch.Tensor:
        if not isinstance(images, torch.Tensor) or images.dim() == 0 or images.shape[0] == 0:
            shape = list(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
            raise UsageError(f"a batch is a tensor of one image or more, [N, channels, height, width]; not {shape}")
        images = images.to(self.device, non_blocking=True)
        return images.contiguous(memory_format=self.memory_format) if images.dim() == 4 else images

    def _eager_step(self, images: torch.Tensor) -> torch.Tensor:
        self._new_batch(images)
        self.method.before_step(images)
        # a method that owns its update runs it even when it trains nothing (ttaug's augmented passes)
        owned = self.method.trains or self.method.owns_update
        prediction, features = self._update(images) if owned else self._predict(images)
        with torch.no_grad():
            prediction = self.method.output(prediction, features)
        self.method.after_step(prediction)
        return prediction

    def features(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits and features a step would report for `images` with the model as adapted so
        far (method.reporting_network), changing nothing: no update, and the statistics a forward
        pass moves (`norm` ema:M, class-balanced, unmix:K) put back after it, so that each batch is seen as
        if it came next in the stream."""
        with self._one_thread():
            return self._features(self._batch(images))

    def _features(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        network = self.method.reporting_network(self)
        saved = {name: value.clone() for name, value in network.state_dict().items()}
        balanced = None if self.balanced is None else self.balanced.saved()
        try:
            self._new_batch(images)
            with torch.no_grad(), self.autocast:
                logits, features = network(images)
        finally:
            network.load_state_dict(saved)
            if balanced is not None:
                self.balanced.restore(balanced)
        return logits.float(), features.float()

    def _new_batch(self, images: torch.Tensor) -> None:
        """class-balanced's running statistics move once a batch, and it first predicts the
        batch with them, as they are, for its class histogram (class_balanced.py); `ema` and
        `unmix` move theirs on every forward pass (norms.py)."""
        if self.balanced is None:
            return
        self.balanced.new_batch()
        with torch.no_grad(), self.autocast, self.balanced.predicting_with_running_statistics():
            logits, _ = self.forward(images)
        self.balanced.set_histogram(balance_histogram(logits.float().softmax(1).mean(0), len(images)))

    def _predict(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad(), self.autocast:  # not inference_mode: callers may change the logits in place
            logits, features = self.forward(images)
        return logits.float(), features.float()

    def _update(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        prediction = reported = skipped = None
        # a caller's evaluation loop is often under no_grad or inference_mode; the update needs gradients
        with torch.inference_mode(False), torch.enable_grad():
            if images.is_inference():  # made under inference_mode: autograd cannot save it for the backward pass
                images = images.clone()
            for _ in range(self.steps if self.method.trains else 1):  # no optimiser steps: one pass
                # the last step's pass is reported, after the batch's earlier steps, as TENT's,
                # EATA's, SAR's and CoTTA's code return it
                if self.method.owns_update:  # SAR, CoTTA...: its own forward passes and steps (base.py)
                    logits, features, skipped = self.method.update(self, images, skipped)
                else:
                    logits, features, loss = self._forward_and_loss(images)
                    skipped = self._apply(loss, skipped, leave_out=self.method.leave_out)
                prediction, reported = logits.detach().float(), features.detach().float()
        return prediction, reported

    def _forward_loss(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with self.autocast:
            logits, features = self.forward(images)
        return logits, features, self.method.loss(logits.float(), features.float())

    def apply(
        self,
        loss: torch.Tensor,
        skipped: torch.Tensor | None = None,
        *,
        leave_out: torch.Tensor | None = None,
        after_backward=None,
    ) -> torch.Tensor:
        """One optimiser step on `loss`, for a method that owns its update (base.py), from
        inside its step (the same thread): see _apply."""
        with self._one_thread():
            return self._apply(loss, skipped, leave_out=leave_out, after_backward=after_backward)

    def _apply(
        self,
        loss: torch.Tensor,
        skipped: torch.Tensor | None,
        *,
        leave_out: torch.Tensor | None = None,
        after_backward=None,
    ) -> torch.Tensor:
        """One optimiser step, left out on the device when the loss or a gradient is not
        finite, so that NaN never reaches the weights; also when `skipped`, the flag of this
        batch's earlier step, is set (the batch's later steps are left out too). Returns this
        step's flag, float [1]: 1 where left out. Each batch's first left-out step is counted.
        With fp16 the loss is scaled for the backward pass and the gradients unscaled before
        the check; an overflow also halves the scale for the next step, while a loss that is
        not finite before scaling, or a step left out after an earlier one, leaves it as it was.
        `leave_out` (a device bool, from the method: EATA when it selected no sample) leaves
        this step out too, without counting it as skipped; `after_backward()` runs once the
        gradients are there, before the step (SAR puts its perturbed weights back there)."""
        self.optimizer.zero_grad(set_to_none=True)
        finite = torch.isfinite(loss)
        if self.scaler is None:
            loss.backward()
        else:
            scaled = self.scaler.scale(loss)  # creates the scale on the first call
            scale = (self.scaler._scale.clone(), self.scaler._growth_tracker.clone())
            scaled.backward()
            self.scaler.unscale_(self.optimizer)
        if after_backward is not None:
            after_backward()
        flag = finite.logical_not().float().reshape(1)
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:  # one pass over all of them on the device, as torch.amp checks them (the scale is 1 here)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, torch.ones_like(flag))
        earlier = torch.zeros_like(flag) if skipped is None else skipped
        flag = torch.maximum(flag, earlier)
        held = flag if leave_out is None else torch.maximum(flag, leave_out.float().reshape(1))
        with torch.no_grad():
            # a step that wrote a value that is not finite (an overflow of low-precision weights) is undone too
            flag = torch.maximum(flag, guarded_step(self.optimizer, held))
            if self.scaler is not None:
                self.scaler.update()
                # as if neither the step nor the update had been tried: no backward pass, no new scale
                untried = (finite.logical_not() | earlier.bool()).reshape(())
                if leave_out is not None:
                    untried = untried | leave_out.reshape(())
                for now, before in zip((self.scaler._scale, self.scaler._growth_tracker), scale):
                    torch.where(untried, before, now, out=now)
            self._skipped += (flag - earlier).long().sum()
        return flag


def _autocast(device: torch.device, precision: str):
    # no cast cache: a CUDA graph capture may not keep one (the cache lasts one forward pass anyway)
    if DTYPES[precision] is None:
        return nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision], cache_enabled=False)
