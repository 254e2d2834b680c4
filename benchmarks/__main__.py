"""``python -m benchmarks``: the performance suite (see benchmarks.suite)."""

import sys

from benchmarks.suite import main

sys.exit(main())
