"""`python -m hybridcache ...`: the `hybridcache` command (for environments whose scripts folder is not on PATH)."""

import sys

from hybridcache.cli import main

sys.exit(main())
