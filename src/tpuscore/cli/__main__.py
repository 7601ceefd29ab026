"""`python -m tpuscore.cli`: the `tpuscore` command."""

import sys

from tpuscore.cli import main

sys.exit(main())
