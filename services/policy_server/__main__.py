"""``python -m services.policy_server`` runs the ``policy-server`` command."""

import sys

from services.policy_server.cli import main

if __name__ == "__main__":
    sys.exit(main())
