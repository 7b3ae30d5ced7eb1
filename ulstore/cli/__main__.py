"""``python -m ulstore.cli``: the ``ulstore`` command."""

import sys

from . import main

sys.exit(main())
