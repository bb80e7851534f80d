"""``python -m allhands.cli``: the ``allhands`` command."""

import sys

from allhands.cli import main

sys.exit(main())
