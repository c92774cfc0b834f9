"""`python -m mjlab_hpc.bench`."""

import sys

from mjlab_hpc.bench.report import main

sys.exit(main())
