"""Options shared by several commands."""

from __future__ import annotations

from typing import Annotated, Optional
import typer
from cafa_cli.data.preprocessing import parse_floats, parse_size


ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="torchvision architecture (resnet50, ...), a bundled model (fmnist-resnet), or a factory: file.py:function or package.module:function.")]


WeightsOpt = Annotated[Optional[str], typer.Option("--weights", "-w", help="State dict: .safetensors, or .pt/.pth (read with weights_only=True).")]


NumClassesOpt = Annotated[Optional[int], typer.Option("--num-classes", help="Outputs of a torchvision architecture or factory.")]


ClassifierOpt = Annotated[Optional[str], typer.Option("--classifier", help="Name of the final nn.Linear (default: the last one).")]


TrustOpt = Annotated[bool, typer.Option("--trust-checkpoint", help="Allow .pt/.pth files that hold Python objects. Unpickling them can run arbitrary code: only for files you trust.")]


LabelsOpt = Annotated[Optional[str], typer.Option("--labels", help="Labels .npy for a --data .npy array.")]


SeverityOpt = Annotated[Optional[int], typer.Option("--severity", help="Pick severity 1-5 from an array stacking five (CIFAR-10-C layout).")]


ResizeOpt = Annotated[Optional[str], typer.Option("--resize", help="Resize the shorter side to this (int or 'none'). Default: the artifact's (adapt), the bundled model's, or 256.")]


CropOpt = Annotated[Optional[str], typer.Option("--crop", help="Centre crop (int or 'none'); default as --resize's, or 224. ImageNet-C is already 224x224: use --resize none --crop none.")]


MeanOpt = Annotated[Optional[str], typer.Option("--mean", help="Normalisation mean, one value or one per channel; default as --resize's, or ImageNet's.")]


StdOpt = Annotated[Optional[str], typer.Option("--std", help="Normalisation std, one value or one per channel; default as --mean's.")]


ChannelsOpt = Annotated[Optional[int], typer.Option("--channels", help="1 (grey) or 3 (RGB).")]


DeviceOpt = Annotated[str, typer.Option("--device", help="auto, cpu, cuda or cuda:N.")]


WorkersOpt = Annotated[Optional[int], typer.Option("--num-workers", show_default=False, help="Data loading processes. Default: on CUDA the CPU cores this process may use, divided among torchrun's ranks on the machine, minus one; on the CPU 0.")]


FractionOpt = Annotated[Optional[float], typer.Option("--fraction", show_default=False, help="Stratified fraction of each class's training images for the statistics, in (0, 1]; default 0.05.")]


PerClassOpt = Annotated[Optional[int], typer.Option("--per-class", help="This many training images per class instead of a --fraction.")]


QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress or summary on stderr.")]


ShrinkageOpt = Annotated[str, typer.Option("--shrinkage", help="'auto' (OAS per class; diag: a λ for the variances alone) or λ in [0, 1]: Σ = (1-λ)S + λ tr(S)/d I. 0 is the paper's unregularised estimate.")]


StrictOpt = Annotated[bool, typer.Option("--strict", help="Fail on the first unreadable image instead of skipping it.")]


# how a model adapts, shared by adapt and bench
BatchSizeOpt = Annotated[int, typer.Option("--batch-size", help="Images per adaptation batch (paper: 200; 64 on ImageNet-C); bench also computes its statistics in batches of this size.")]


OptimizerOpt = Annotated[str, typer.Option("--optimizer", help="adam, sgd, or nesterov (SGD with Nesterov momentum, as TENT's ImageNet-C code).")]


LrOpt = Annotated[float, typer.Option("--lr", help="Learning rate.")]


MomentumOpt = Annotated[float, typer.Option("--momentum", help="Momentum of sgd and nesterov (adam ignores it).")]


StepsOpt = Annotated[int, typer.Option("--steps", help="Gradient steps per batch.")]


ParamsOpt = Annotated[str, typer.Option("--params", help="norm (normalisation affines) or all (the whole feature extractor).")]


BnPriorOpt = Annotated[float, typer.Option("--bn-prior", help="Source BN statistics count as this many samples (0: test batch only).")]


ResetOpt = Annotated[str, typer.Option("--reset", help="domain (each --data from the source weights), episodic (every batch), never (continual).")]


PrecisionOpt = Annotated[str, typer.Option("--precision", help="fp32, bf16 or fp16 (autocast, CUDA only).")]


CompileOpt = Annotated[bool, typer.Option("--compile", help="torch.compile the model (pays a compilation on the first batches).")]


def _preprocessing_changes(resize=None, crop=None, mean=None, std=None, channels=None, prefix: str = "--") -> dict:
    """The preprocessing options given (None: not given), parsed; `prefix` names them in
    errors (`--test-` for bench's test geometry)."""
    texts = {"resize": (resize, parse_size), "crop": (crop, parse_size), "mean": (mean, parse_floats), "std": (std, parse_floats)}
    changes = {key: parse(text, f"{prefix}{key}") for key, (text, parse) in texts.items() if text is not None}
    return changes if channels is None else {**changes, "channels": channels}
