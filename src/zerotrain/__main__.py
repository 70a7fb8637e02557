"""``python -m zerotrain ...``: the ``zerotrain`` command."""
import sys

from .cli import main

sys.exit(main())
