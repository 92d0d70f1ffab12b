"""Which weights cafa-robust keeps at each detected change of domain: `cafa adapt` as given,
with CafaRobust.restart wrapped to print, per change, whether the carried or the source
affines went on (a diagnosis of `restart_weights`; the tool itself counts only the changes).

    PYTHONPATH=src python benchmarks/robust_restart_choices.py OUT.json adapt -d … --method cafa-robust …
"""

import json
import sys

import torch

from cafa_cli.__main__ import main
from cafa_cli.method.methods import cafa_robust

choices = []
restart = cafa_robust.CafaRobust.restart


def logged_restart(self, adapter, images):
    before = [p.detach().clone() for p in self.params]
    restart(self, adapter, images)
    carried = all(torch.equal(p, b) for p, b in zip(self.params, before))
    choices.append({"change": self.domain_changes, "kept": "carried" if carried else "source"})
    print(json.dumps(choices[-1]), file=sys.stderr, flush=True)


if __name__ == "__main__":
    out = sys.argv.pop(1)
    cafa_robust.CafaRobust.restart = logged_restart
    try:
        main()
    finally:
        with open(out, "w") as f:
            json.dump(choices, f, indent=1)
