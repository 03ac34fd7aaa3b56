"""``python -m ember.bench``: the suite, or with ``--child`` the server process it starts."""

import sys

from . import main

sys.exit(main())
