"""`python -m benchmarks`."""

import sys

from benchmarks.report import main

sys.exit(main())
