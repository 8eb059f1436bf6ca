"""``python -m xavier_async.bench``: the same as the ``xavier-async`` command."""

import sys

from .cli import main

sys.exit(main())
