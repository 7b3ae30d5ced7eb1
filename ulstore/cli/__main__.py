"""``python -m ulstore.cli``: the ``ulstore`` command."""

import sys

from . import main

__all__: list[str] = []

sys.exit(main())
