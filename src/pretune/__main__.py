"""``python -m pretune`` = the ``pretune`` command."""

import sys

from .cli import main

sys.exit(main())
