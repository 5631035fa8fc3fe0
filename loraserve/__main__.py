"""`python -m loraserve ...`: the same command line as `loraserve ...`."""

import sys

from loraserve.cli import main

sys.exit(main())
