"""``python -m services.cli``: the ``evalforge`` command (the stack and the tests start its verbs so)."""

import sys

from services.cli import main

sys.exit(main())
