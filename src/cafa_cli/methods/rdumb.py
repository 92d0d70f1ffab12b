"""RDumb (Press et al., "RDumb: A simple approach that questions our progress in continual
test-time adaptation", NeurIPS 2023): ETA whose model goes back to the source weights
after every 1,000 updates, whatever the stream does.

The method is ETA's update unchanged (eata.py); what makes it RDumb is its schedule, which
is the stream's: its recipe (recipes/rdumb.toml) sets `reset` every:1000, the same
`--reset every:N` that any method can run under (jobs/adapt/stream.py). So `cafa adapt
--method rdumb --reset never` is plain ETA, and `--method eta --reset every:1000` is RDumb.
The class exists for its name alone: results, recipes and `cafa methods` say rdumb.
"""

from __future__ import annotations

from cafa_cli.methods.eata import Eta


class RDumb(Eta):
    name = "rdumb"
