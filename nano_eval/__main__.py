"""`python -m nano_eval ...`: the command line (see nano_eval.cli)."""

import sys

from nano_eval.cli import main

sys.exit(main())
