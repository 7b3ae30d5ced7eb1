"""``python -m ulstore``: the ``ulstore`` command (as ``python -m ulstore.cli``)."""

import sys

from .cli import main

__all__: list[str] = []

sys.exit(main())
