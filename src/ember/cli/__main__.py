"""``python -m ember.cli``: the ``ember`` command."""

import sys

from .main import main

sys.exit(main())
