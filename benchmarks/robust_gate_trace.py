"""cafa-robust's gate batch by batch: what it read and what share of the statistics it gave.

Runs `cafa` with the arguments given (a `bench` or an `adapt` of cafa-robust) and writes, for
every batch the method predicted, a JSON line: the images before it, the gate's skew s (after
`entropy_rise`'s scale), that scale (null when the batch was not read as skewed, or the option
is 0), the batch's share ρ of the statistics, whether a change of domain restarted the
statistics before it, and when each image in the bank after the batch arrived (its number in
the stream, sorted), and, per BatchNorm in order, how far the variance of its input in the
gate's pass jumped from the batch before (the change detector's statistic, mean over channels
of ln² of the ratio, which the detector reads at the first layer alone). A diagnosis of a
stream (docs/design/cafa-robust.md), not a part of the method.

    PYTHONPATH=src python benchmarks/robust_gate_trace.py trace.jsonl bench DOMAIN... \
        --methods cafa-robust --recipe cifar10-c --seeds 0 --reset never
"""

from __future__ import annotations

import json
import runpy
import sys

# Internal, what this traces (tests/test_api.py lists it): cafa-robust's gate and layers, wrapped
from cafa_cli.methods.cafa_robust import CafaRobust, SharedStatisticsNorm, variance_jump


def traced(out) -> None:
    """Wrap CafaRobust's update, batch_share and few_classes, and the layers' forward, so that
    each new batch writes a line to `out`."""
    update, few_classes, batch_share = CafaRobust.update, CafaRobust.few_classes, CafaRobust.batch_share
    forward = SharedStatisticsNorm.forward
    images = 0
    gate = {"on": False, "variances": [], "before": None}  # the layers' input variances in the watched gate pass

    def forward_traced(self, x):
        if gate["on"]:
            dims = [0] + list(range(2, x.dim()))
            gate["variances"].append(x.float().var(dims, unbiased=False).double())
        return forward(self, x)

    def batch_share_traced(self, adapter, batch, watch=None):
        gate["on"] = watch is not None and not gate["variances"]  # the batch's first pass only
        try:
            return batch_share(self, adapter, batch, watch)
        finally:
            gate["on"] = False

    def jumps(self) -> list[float]:
        now = gate["variances"][: len(self.layers)]
        before, gate["before"], gate["variances"] = gate["before"], now, []
        if before is None or len(before) != len(now):
            return []
        return [round(variance_jump(v, b, self.layers[0].eps), 4) for v, b in zip(now, before)]

    def few_classes_traced(self, adapter, batch, global_logits):
        self.traced_scale = float(scale := few_classes(self, adapter, batch, global_logits))
        return scale

    def update_traced(self, adapter, batch, skipped):
        nonlocal images
        fresh, changes_before, self.traced_scale = self.fresh, self.domain_changes, None
        result = update(self, adapter, batch, skipped)
        if fresh:
            s = float(self.skew)
            n_eff = len(batch) * (1 - s) ** self.gate_power
            line = {
                "images": images,
                "skew": round(s, 4),
                "scale": None if self.traced_scale is None else round(self.traced_scale, 4),
                "share": round(n_eff / (n_eff + self.prior), 4),
                "restart": self.domain_changes != changes_before,
                "bank_arrivals": sorted(a for a, c in zip(self.bank.host_arrivals, self.bank.host_labels) if c >= 0),
                "variance_jumps": jumps(self),
            }
            out.write(json.dumps(line) + "\n")
            images += len(batch)
        return result

    CafaRobust.update, CafaRobust.few_classes = update_traced, few_classes_traced
    CafaRobust.batch_share, SharedStatisticsNorm.forward = batch_share_traced, forward_traced


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    with open(sys.argv[1], "w") as out:
        traced(out)
        sys.argv = ["cafa", *sys.argv[2:]]
        try:
            runpy.run_module("cafa_cli", run_name="__main__")  # python -m cafa_cli, traced
        except SystemExit as exit:
            if exit.code:
                raise


if __name__ == "__main__":
    main()
