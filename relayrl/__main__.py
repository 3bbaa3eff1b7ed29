"""``python -m relayrl ...``: the ``relayrl`` command (for an environment whose scripts are not on PATH)."""

import sys

from relayrl.cli.main import main

sys.exit(main())
