"""The Adapter's steady-state step as one CUDA graph, replayed once a batch.

On a GPU a step of a few hundred small kernels takes the host longer to launch than the
device to run (TENT, ResNet-50 on an H200: ~25 ms of host against ~18 ms of device time a
step): the device waits on Python. A captured step is one launch.

A capture records kernels and the addresses they read and write; a replay runs them again
on whatever those addresses hold. So a step can be replayed only if it is device work alone
and keeps its state in place: no tensor it keeps is replaced by a new one, no Python value
it reads moves from batch to batch, no host reads, no random numbers, one shape.

`StepGraph` runs a step function that way, for the Adapter (adapter.py says when it is used):

1. The first `WARMUP` batches of a stream run eagerly, on the stream the capture will use
   (torch's lazy set-ups, cuBLAS workspaces among them, must happen outside a capture, as
   must the state and caches a step makes on its first batch of a shape): `WARMUP`
   batches of one shape in a row, the count starting again at a batch of another shape.
   The last two are compared: if a step replaced a tensor of the state or changed a Python
   value in it, the step is not replayable, and every batch runs eagerly from then on.
2. The next batch is captured, then checked once: the same batch is stepped eagerly from
   the same state, the state put back, and the graph replayed. Its prediction and the
   state it leaves must match the eager step's (within float tolerance: cuDNN's reductions
   need not round alike from one launch to the next). A mismatch, or an error while
   capturing, keeps the eager step's result and turns the graph off.
3. Each later batch of the captured shape is copied into the graph's input and replayed; a
   batch of another shape (a domain's shorter last batch) runs eagerly, which the graph
   does not mind: both change the same tensors in place.

`drop()` (the Adapter's reset(): a new optimiser, the method's state made again) starts
over from step 1. Capture and replay are the `capture` argument, so that the logic above
is tested on the CPU with an emulated graph (tests/test_step_graph.py).
"""

from __future__ import annotations

import gc
import inspect
from contextlib import contextmanager
from typing import Callable

import torch

WARMUP = 3  # eager batches before a capture, as torch's CUDA graph examples warm up
TOLERANCE = 1e-3  # of a tensor's largest magnitude: how far a replay may be from an eager step


class CudaCapture:
    """A step function captured in a CUDA graph on `stream`; replay() runs it and returns
    the outputs the capture made (overwritten by the next replay)."""

    def __init__(self, function: Callable[[], torch.Tensor], stream):
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: the data loader's threads (pinning batches) may call CUDA meanwhile
        with _no_garbage_collection(), torch.cuda.graph(self.graph, stream=stream, capture_error_mode="thread_local"):
            self.output = function()

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.output


class StepGraph:
    """`step(images) -> prediction` (eager), replayed from a CUDA graph where it can be.
    `state()` lists what the step keeps: {name: tensor or Python value}; the tensors whose
    names start with one of `written` are taken as written by every step (torch's version
    counter, which finds the others, does not see the writes of its fused optimisers)."""

    def __init__(
        self,
        step: Callable[[torch.Tensor], torch.Tensor],
        state: Callable[[], dict],
        device: torch.device,
        capture=CudaCapture,
        written: tuple[str, ...] = (),
    ):
        self.step, self.state, self.capture, self.always_written = step, state, capture, written
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.off: str | None = None  # why the graph is off for good: every batch eager
        self.failed: str | None = None  # the same, when a check or a capture turned it off
        self.replays = 0
        self.drop()

    def drop(self) -> None:
        """Start again from the warm-up (the step's state was made anew)."""
        self.captured, self.shape, self.input = None, None, None
        self.warm, self.written = 0, None  # warm-up batches of `shape` in a row

    @property
    def status(self) -> str:
        """What runs the steps: `graph` once a capture was checked, else why not (yet)."""
        if self.off is not None:
            return f"eager: {self.off}"
        return "graph" if self.captured is not None else "eager: warming up"

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if self.off is not None:
            return self.step(images)
        if self.captured is not None:
            if images.shape != self.shape or images.stride() != self.input.stride():
                return self.step(images)
            self.input.copy_(images)
            self.replays += 1
            return self.captured.replay().clone()  # the next replay overwrites the graph's output
        if self.warm < WARMUP or images.shape != self.shape:
            return self._warm_up(images)
        return self._capture(images)

    def _warm_up(self, images: torch.Tensor) -> torch.Tensor:
        if images.shape != self.shape:
            self.shape, self.warm = images.shape, 0
        before = self.state()
        versions = {name: value._version for name, value in before.items() if isinstance(value, torch.Tensor)}
        with self._side_stream():
            prediction = self.step(images)
        self.warm += 1
        if self.warm < WARMUP:
            return prediction
        # the last warm-up step is the steady state: what it replaced or moved, a replay could not
        after = self.state()
        moved = [name for name in before.keys() | after.keys() if not _same(before.get(name), after.get(name))]
        if moved:
            self.off = self.failed = f"a step replaces or moves {', '.join(sorted(moved)[:3])}"
        # what a step writes: what a capture's check puts back
        self.written = [
            name
            for name, version in versions.items()
            if after[name]._version != version or name.startswith(self.always_written)
        ]
        return prediction

    def _capture(self, images: torch.Tensor) -> torch.Tensor:
        state = self.state()
        written = {name: state[name] for name in self.written}
        with self._side_stream():
            before = {name: value.clone() for name, value in written.items()}
            eager = self.step(images)
            after = {name: value.clone() for name, value in written.items()}
            _put_back(written, before)
            self.input = images.clone()
            try:
                self.captured = self.capture(lambda: self.step(self.input), self.stream)
                replayed = self.captured.replay().clone()
                matches = _close(replayed, eager) and all(_close(written[name], after[name]) for name in written)
            except RuntimeError as error:  # a kernel or call that cannot be captured
                self.off, matches = f"the capture failed ({str(error).splitlines()[0][:120]})", False
            if not matches:
                self.off = self.failed = self.off or "a replay did not match the eager step"
                self.captured = None
                _put_back(written, after)
                return eager
        self.replays += 1
        return replayed

    @contextmanager
    def _side_stream(self):
        if self.stream is None:
            yield
            return
        current = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            yield
        current.wait_stream(self.stream)


@contextmanager
def _no_garbage_collection():
    """Collect now and not during a capture: a collection that frees an earlier graph (a
    reset Adapter's, another bench row's) calls CUDA in the capturing thread, which ends the
    capture with 'operation not permitted when stream is capturing'. torch >= 2.9 no longer
    collects before a capture (pytorch/pytorch#161037); on an H200 one capture in 78 failed so."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def kept_state(roots: dict, skip: tuple[str, ...] = ()) -> dict:
    """{dotted name: tensor or Python value} of everything reachable from `roots` through
    dicts, lists, tuples and objects' attributes (not torch's objects: an nn.Module's tensors
    are the model's state dict, given as a root), leaving out the attributes `skip` names."""
    found: dict = {}
    seen: set[int] = set()

    def walk(value, name: str) -> None:
        if isinstance(value, (torch.Tensor, int, float, bool, str, type(None))):
            found[name] = value
            return
        if id(value) in seen or isinstance(value, torch.nn.Module):
            return
        seen.add(id(value))
        if isinstance(value, dict):
            items = value.items()
        elif isinstance(value, (list, tuple)):
            items = enumerate(value)
        elif (
            hasattr(value, "__dict__")
            and not isinstance(value, type)
            and not inspect.isroutine(value)
            and not type(value).__module__.startswith("torch")
        ):  # a method's own objects, a plug-in's too
            items = ((key, item) for key, item in vars(value).items() if key not in skip)
        else:
            return
        for key, item in items:
            walk(item, f"{name}.{key}")

    for name, root in roots.items():
        walk(root, name)
    return found


def _same(before, after) -> bool:
    if isinstance(before, torch.Tensor) or isinstance(after, torch.Tensor):
        return before is after
    return before == after


def _put_back(tensors: dict, values: dict) -> None:
    with torch.no_grad():
        for name, tensor in tensors.items():
            tensor.copy_(values[name])


def _close(value: torch.Tensor, expected: torch.Tensor) -> bool:
    if value.shape != expected.shape:
        return False
    if not value.is_floating_point():
        return bool(torch.equal(value, expected))
    value, expected = value.double(), expected.double()
    if not torch.equal(value.isfinite(), expected.isfinite()):
        return False
    finite = expected.isfinite()
    scale = expected[finite].abs().max() if finite.any() else torch.zeros((), dtype=torch.float64)
    return bool(((value - expected)[finite].abs() <= TOLERANCE * scale.clamp_min(1e-30)).all())
