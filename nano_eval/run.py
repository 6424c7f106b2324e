"""Script entry point: `python nano_eval/run.py ...` and `torchrun --nproc_per_node=N nano_eval/run.py ...`.

Run as a script, Python puts this file's folder (nano_eval/) first on sys.path, where a module such as
nano_eval/x.py would hide an installed package named x. So this folder leaves sys.path before anything else is
imported; the checkout it belongs to is appended last, for running from a checkout without installing.
Everything else is nano_eval.cli.main (as for the `nano_eval` console script and `python -m nano_eval`).
"""

import os
import sys

if __name__ == "__main__":
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
    if os.path.dirname(_here) not in sys.path:
        sys.path.append(os.path.dirname(_here))

from nano_eval.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
