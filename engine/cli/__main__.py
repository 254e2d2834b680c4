"""``python -m engine.cli``: the command line (tests and scripts start it this way)."""

import sys

from engine.cli import main

sys.exit(main())
