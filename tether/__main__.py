"""``python -m tether`` is the ``tether`` command."""

import sys

from tether.commands.cli import main

sys.exit(main())
