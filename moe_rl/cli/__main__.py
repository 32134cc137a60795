"""`python -m moe_rl.cli`: the `moe-rl` command."""

import sys

from moe_rl.cli import main

sys.exit(main())
