"""`python -m dtlab ...` works like the `dtlab` command."""

import sys

from dtlab.cli.main import main

sys.exit(main())
