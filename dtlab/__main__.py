"""`python -m dtlab ...` works like the `dtlab` command."""

import sys

from dtlab.cli import main

sys.exit(main())
