"""The feature hook: a classifier wrapped so that its forward pass returns the logits
and the features entering its final linear layer."""

from __future__ import annotations

import torch
from torch import nn

from cafa_cli.core.devices import DEVICE_FAILURES
from cafa_cli.core.errors import InputError, UsageError, out_of_memory


def find_classifier(model: nn.Module, name: str | None = None) -> tuple[str, nn.Linear]:
    """The final nn.Linear: `fc` in ResNets, `classifier.N` in EfficientNet/MobileNet,
    `heads.head` in ViT — the last Linear in registration order, or `name`."""
    modules = dict(model.named_modules())
    if name is not None:
        layer = modules.get(name)
        if not isinstance(layer, nn.Linear):
            linears = [n for n, m in modules.items() if isinstance(m, nn.Linear)]
            raise UsageError(
                f"`classifier` {name}: no nn.Linear of that name"
                + (f" (linear layers: {', '.join(linears[-5:])})" if linears else "")
            )
        return name, layer
    linears = [(n, m) for n, m in modules.items() if isinstance(m, nn.Linear)]
    if not linears:
        raise InputError(
            "the model has no nn.Linear classifier layer; CAFA needs the features that enter one (see `classifier`)"
        )
    return linears[-1]


class FeatureClassifier(nn.Module):
    """Wraps a classifier so that forward returns (logits, features)."""

    def __init__(self, model: nn.Module, classifier_name: str | None = None):
        super().__init__()
        if isinstance(model, FeatureClassifier):  # its forward returns a tuple, which no classifier layer follows
            raise UsageError("the model is a FeatureClassifier already (load_model returns one): use it as it is")
        self.model = model
        self.classifier_name, self.classifier = find_classifier(model, classifier_name)
        self._features: torch.Tensor | None = None
        self._in_forward = False
        self.classifier.register_forward_pre_hook(self._keep_features)
        # the model outputs that are the classes (a class subset: ImageNet-R's 200 of 1000);
        # None: all. A buffer outside the state_dict, so that it follows the model's device
        # and leaves the weights' fingerprint and reset() alone
        self.register_buffer("outputs", None, persistent=False)

    def restrict_outputs(self, outputs: list[int]) -> None:
        """Predict among these model outputs only: forward returns their logits, in this order,
        so that every method's loss (entropy, pseudo-labels) sees the subset's classes alone."""
        if not outputs or len(set(outputs)) != len(outputs) or not all(0 <= o < self.model_outputs for o in outputs):
            raise UsageError(
                f"a class subset must name distinct model outputs in [0, {self.model_outputs}), not {outputs[:5]}..."
            )
        self.outputs = torch.as_tensor(outputs, dtype=torch.long, device=self.classifier.weight.device)

    def head(self, features: torch.Tensor) -> torch.Tensor:
        """The classifier's logits of `features`, for the classes predicted among."""
        logits = self.classifier(features)
        return logits if self.outputs is None else logits.index_select(1, self.outputs)

    def class_weights(self) -> torch.Tensor:
        """The classifier's weight rows of the classes predicted among (T3A's first prototypes)."""
        weight = self.classifier.weight
        return weight if self.outputs is None else weight.index_select(0, self.outputs)

    def _keep_features(self, module, inputs):
        # only inside our own forward: a call to the bare net, or through a second wrapper
        # of it, would otherwise leave features (and their graph) held here until our next call
        if self._in_forward:
            self._features = inputs[0]

    @property
    def feature_dim(self) -> int:
        return self.classifier.in_features

    @property
    def model_outputs(self) -> int:
        return self.classifier.out_features

    @property
    def num_classes(self) -> int:
        """The classes predicted among: the model's outputs, or those of a class subset."""
        return self.classifier.out_features if self.outputs is None else len(self.outputs)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._in_forward = True
        try:
            logits = self.model(x)
        except DEVICE_FAILURES:
            raise  # the GPU's, not the images': out of memory, a CUDA or cuDNN error
        except (RuntimeError, AssertionError) as error:
            if out_of_memory(error):  # torch's CPU allocator: the host's memory, not the images
                raise
            # a shape or channel mismatch surfaces deep inside a layer (torchvision's ViT
            # asserts its image size); say which input it was
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            weights = next((p.dtype for p in self.model.parameters()), x.dtype)
            if x.dtype != weights:  # only through the Python API: the CLI's batches are float32, as checked models are
                raise InputError(
                    f"the images are {x.dtype} but the model's weights are {weights}: give images of the "
                    f"weights' dtype ({first_line})"
                ) from error
            raise InputError(
                f"the model cannot take these images (a batch of shape {list(x.shape)}): {first_line}; "
                f"check `channels`, `resize` and `crop` against the input the model expects"
            ) from error
        finally:
            self._in_forward = False
            features, self._features = self._features, None
        if features is None:
            raise InputError(
                f"the classifier layer {self.classifier_name} was not called in the forward pass; name the right one "
                "with `classifier`"
            )
        if features.dim() != 2:
            raise InputError(
                f"the features entering {self.classifier_name} have shape {tuple(features.shape)}, not [batch, dim]; "
                f"name a classifier that takes pooled features with `classifier`"
            )
        if (
            not isinstance(logits, torch.Tensor)
            or logits.dim() != 2
            or len(logits) != len(x)
            or not logits.is_floating_point()
        ):
            shape = (
                f"a {type(logits).__name__}"
                if not isinstance(logits, torch.Tensor)
                else f"{logits.dtype} of shape {list(logits.shape)}"
            )
            raise InputError(
                f"the model returns {shape} for a batch of {len(x)}, not float logits [batch, classes]; "
                f"give a factory whose forward returns the logits only"
            )
        if logits.shape[1] != self.model_outputs:
            raise InputError(
                f"the model returns {logits.shape[1]} logits but {self.classifier_name} has {self.model_outputs} "
                "outputs, "
                f"so it is not the layer that makes the logits; name that one with `classifier`"
            )
        if self.outputs is not None:
            logits = logits.index_select(1, self.outputs)
        return logits, features
