"""``python -m dropbp`` is the ``dropbp`` command."""

import sys

from dropbp.tools.cli import main

sys.exit(main())
