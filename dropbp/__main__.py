"""``python -m dropbp`` is the ``dropbp`` command."""

import sys

from .cli import main

sys.exit(main())
