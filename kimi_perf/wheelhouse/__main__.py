"""``python -m kimi_perf.wheelhouse plan|build|stage|repack``: see :mod:`kimi_perf.wheelhouse.cli`."""

import sys

from .cli import main

sys.exit(main())
