"""`python -m vlinfer ...`: the command line (vlinfer/cli/)."""
import sys

from vlinfer.cli import main

sys.exit(main())
