"""Streaming class-conditional moments of the features: counts, means and scatter
matrices accumulated in float64, mergeable across shards."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from cafa_cli.core.errors import InputError, UsageError

SQUARABLE = float(torch.finfo(torch.float32).max) ** 0.5  # the largest value whose square is a float32


class ClassMoments:
    """Per-class count, mean and scatter matrix (M2 = Σ (x-μ)(x-μ)ᵀ), streamed.

    Rows wait in a float32 buffer until a class has as many rows as dimensions; only
    then is a d×d float64 scatter allocated and the buffer folded in with Chan's
    parallel update. A class with fewer samples than dimensions — every class of a
    5% ImageNet subset — never holds more than its own rows, so memory stays at
    min(N_c, d)·d per class instead of d² per class.
    """

    def __init__(self, num_classes: int, dim: int):
        self.num_classes, self.dim = num_classes, dim
        self.count = torch.zeros(num_classes, dtype=torch.int64)
        self.mean = torch.zeros(num_classes, dim, dtype=torch.float64)
        self.scatter: dict[int, torch.Tensor] = {}
        self.pending: list[list[torch.Tensor]] = [[] for _ in range(num_classes)]
        self.pending_rows = [0] * num_classes
        self.skipped_images = 0  # unreadable images passed over while streaming
        self.consumed = False  # set by estimate(), which frees the scatters
        self.norm_inputs: NormInputMoments | None = None  # cafa stats --norm-moments: the BatchNorms' inputs per class

    def update(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        if self.consumed:
            raise UsageError("these moments were already estimated, which freed them; accumulate new ClassMoments")
        features = features.detach().to("cpu", torch.float32)
        labels = torch.as_tensor(labels).to("cpu")
        if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
            raise UsageError(f"labels must be integer class indices, not {labels.dtype}")
        if features.dim() != 2 or features.shape[1] != self.dim or labels.shape != features.shape[:1]:
            raise UsageError(
                f"moments of {self.dim}-dimensional features take features [n, {self.dim}] and labels [n], "
                f"not {list(features.shape)} and {list(labels.shape)}"
            )
        if len(labels) and not (0 <= int(labels.min()) and int(labels.max()) < self.num_classes):
            raise UsageError(
                f"labels must be class indices in [0, {self.num_classes}), not {int(labels.min())}..{int(labels.max())}"
            )
        if len(features) and not float(features.abs().amax()) <= SQUARABLE:
            # they would poison every moment of their class, and the artifact with it
            raise InputError(
                f"the model's features hold NaN, infinite or huge values (above {SQUARABLE:.1e}, whose squares "
                f"overflow float32); check `mean` and `std` (a tiny `std` overflows) and the weights "
                f"(out-of-range or non-float values)"
            )
        for c in labels.unique().tolist():
            rows = features[labels == c]
            self.pending[c].append(rows)
            self.pending_rows[c] += len(rows)
            if self.pending_rows[c] >= self.dim:
                self._fold(c)

    def _fold(self, c: int) -> None:
        if not self.pending_rows[c]:
            return
        rows = torch.cat(self.pending[c]).double()
        self.pending[c], self.pending_rows[c] = [], 0
        mean_b = rows.mean(0)
        centred = rows - mean_b
        self._merge(c, len(rows), mean_b, centred.T @ centred)

    def _merge(self, c: int, n_b: int, mean_b: torch.Tensor, scatter_b: torch.Tensor) -> None:
        """Chan et al.'s parallel update of (N, μ, M2) with another part's."""
        n_a = int(self.count[c])
        n = n_a + n_b
        delta = mean_b - self.mean[c]
        self.mean[c] += delta * (n_b / n)
        if c in self.scatter:
            self.scatter[c] += scatter_b + torch.outer(delta, delta) * (n_a * n_b / n)
        else:
            self.scatter[c] = scatter_b
        self.count[c] = n

    def absorb(self, other: ClassMoments) -> None:
        """Add another shard's moments (e.g. another rank's under torchrun)."""
        self.skipped_images += other.skipped_images
        if self.norm_inputs is not None and other.norm_inputs is not None:
            self.norm_inputs.absorb(other.norm_inputs)
        for c in range(self.num_classes):
            if int(other.count[c]):
                self._merge(c, int(other.count[c]), other.mean[c], other.scatter[c])
            if other.pending_rows[c]:
                self.pending[c] += other.pending[c]
                self.pending_rows[c] += other.pending_rows[c]
                if self.pending_rows[c] >= self.dim:
                    self._fold(c)

    def total(self, c: int) -> int:
        """N_c, counting rows still in the buffer."""
        return int(self.count[c]) + self.pending_rows[c]

    def rows(self, c: int) -> torch.Tensor | None:
        """The rows of a class that was never folded into a scatter (N_c < d), float64;
        None once the class has a scatter. Reads the buffer without allocating d×d."""
        if c in self.scatter or int(self.count[c]):
            return None
        if not self.pending_rows[c]:
            return torch.zeros(0, self.dim, dtype=torch.float64)
        return torch.cat(self.pending[c]).double()

    def moments(self, c: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(N_c, μ_c, M2_c) in float64; folds what is pending."""
        self._fold(c)
        scatter = self.scatter.get(c)
        if scatter is None:
            scatter = torch.zeros(self.dim, self.dim, dtype=torch.float64)
        return int(self.count[c]), self.mean[c].clone(), scatter

    def release(self, c: int) -> None:
        """Forget a class's scatter (and buffered rows) once its factor is made."""
        self.scatter.pop(c, None)
        self.pending[c] = []


class NormInputMoments:
    """Per class, the mean and variance of each BatchNorm's input, per channel over a
    class's images and positions (`norm` class-balanced's source moments), streamed in
    float64 on the device. Hooks on the BatchNorms keep each forward pass's per-image
    channel means; `update(labels)` after the pass adds them to the labels' classes."""

    def __init__(self, net: torch.nn.Module, num_classes: int, device: torch.device):
        from torch.nn.modules.batchnorm import _BatchNorm

        self.layers = {name: m for name, m in net.named_modules() if isinstance(m, _BatchNorm)}
        self.counts = torch.zeros(num_classes, dtype=torch.float64, device=device)
        self.sums = {
            name: torch.zeros(num_classes, m.num_features, dtype=torch.float64, device=device)
            for name, m in self.layers.items()
        }
        self.squares = {name: torch.zeros_like(t) for name, t in self.sums.items()}
        self.batch: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.hooks = [m.register_forward_pre_hook(self._keeper(name)) for name, m in self.layers.items()]

    def _keeper(self, name: str):
        def keep(module, inputs):
            x = inputs[0].detach().float()
            dims = list(range(2, x.dim()))
            self.batch[name] = (x.mean(dims) if dims else x, x.square().mean(dims) if dims else x.square())

        return keep

    def update(self, labels: torch.Tensor) -> None:
        labels = labels.to(self.counts.device)
        self.counts.index_add_(0, labels, torch.ones(len(labels), dtype=torch.float64, device=labels.device))
        for name, (mean, square) in self.batch.items():
            self.sums[name].index_add_(0, labels, mean.double())
            self.squares[name].index_add_(0, labels, square.double())
        self.batch = {}

    def close(self) -> None:
        """Remove the hooks, and move the sums to the CPU (to be gathered or written)."""
        for hook in self.hooks:
            hook.remove()
        self.hooks, self.layers = [], {}
        self.counts = self.counts.cpu()
        self.sums = {name: t.cpu() for name, t in self.sums.items()}
        self.squares = {name: t.cpu() for name, t in self.squares.items()}

    def absorb(self, other: NormInputMoments) -> None:
        self.counts += other.counts
        for name in self.sums:
            self.sums[name] += other.sums[name]
            self.squares[name] += other.squares[name]

    def moments(self, rows: list[int] | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{layer: (means, variances) [C, channels]} in float64 (of `rows`' classes only, when given)."""
        counts = self.counts.clamp_min(1)[:, None]
        out = {}
        for name in self.sums:
            mean = self.sums[name] / counts
            var = (self.squares[name] / counts - mean.square()).clamp_min(0)
            out[name] = (mean, var) if rows is None else (mean[rows], var[rows])
        return out


def accumulate_features(
    model: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    batches: Iterable,
    labels: torch.Tensor,
    num_classes: int,
    dim: int,
    device: torch.device,
    on_batch: Callable[[object], None] | None = None,  # called with each batch, after it
) -> ClassMoments:
    """Stream batches through the model (eval mode, no gradients) into ClassMoments.

    `model` takes a batch's images as the loader gives them, moved to `device`, and
    returns (logits, features); `labels` is indexed by each batch's domain positions.
    """
    moments = ClassMoments(num_classes, dim)
    waiting = None  # on CUDA: the previous batch's features, copying to the host
    # no_grad rather than inference_mode: the moments are updated in place later
    with torch.no_grad():
        for batch in batches:
            if batch.images is not None:
                _, features = model(batch.images.to(device, non_blocking=True))
                if device.type == "cuda":
                    # queue this batch's copy, then fold the previous one in while the GPU
                    # runs ahead, so that the host work does not stall the forward passes
                    copied = torch.empty(features.shape, dtype=torch.float32, pin_memory=True)
                    copied.copy_(features, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(torch.cuda.current_stream(features.device))  # the copy's stream, not cuda:0's
                    if waiting is not None:
                        _fold_when_copied(moments, *waiting)
                    waiting = (copied, done, labels[batch.indices])
                else:
                    moments.update(features, labels[batch.indices])
            if on_batch is not None:
                on_batch(batch)
    if waiting is not None:
        _fold_when_copied(moments, *waiting)
    return moments


def _fold_when_copied(moments: ClassMoments, features: torch.Tensor, done, labels: torch.Tensor) -> None:
    done.synchronize()
    moments.update(features, labels)
