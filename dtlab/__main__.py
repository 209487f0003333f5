"""`python -m dtlab ...` works like the `dtlab` command."""

import sys

from .cli import main

sys.exit(main())
