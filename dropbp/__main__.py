"""``python -m dropbp`` is the ``dropbp`` command."""

import sys

from .tools.cli import main

sys.exit(main())
