"""`python -m freetoken_agents.cli ARGS` = `freetoken ARGS`."""

import sys

from . import main

sys.exit(main())
