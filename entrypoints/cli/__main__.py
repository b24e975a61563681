"""`python -m replayllm.entrypoints.cli ARGS`: the `replayllm` console script."""

import sys

from .main import main

sys.exit(main())
