"""The `cafa` command and `python -m cafa_cli`.

`python -m` puts the working folder first on the import path; a `timm.py` or `torch.py`
there (a cloned repository, a downloaded results folder) would then be imported in place
of the library. Run so, the working folder is taken off the path before anything else is
imported, so both commands find only installed packages (and PYTHONPATH's).

Importing torch takes seconds; a SIGTERM or Ctrl-C in that window would otherwise kill
the process by the signal (exit 143, or a traceback from inside an import). Until the
CLI installs its own handlers, an interruption just exits 130, as it does later on.
"""

import os
import signal
import sys


def _interrupted_while_starting(signum, frame):
    sys.stderr.write("cafa: interrupted\n")
    os._exit(130)  # nothing has been opened or written yet


def main() -> None:
    signal.signal(signal.SIGTERM, _interrupted_while_starting)
    signal.signal(signal.SIGINT, _interrupted_while_starting)
    from cafa_cli.cli.app import main as run

    run()


if __name__ == "__main__":
    if sys.path and sys.path[0] in ("", os.getcwd()):
        del sys.path[0]
    main()
