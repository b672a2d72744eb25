"""`python -m pagedserve.bench` is `pagedserve bench`."""

import sys

from pagedserve.bench.cli import main

sys.exit(main())
