"""`python -m portcullis.cli ...`, the same as the `portcullis` console script."""

import sys

from portcullis.cli import main

sys.exit(main())
