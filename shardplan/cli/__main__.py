"""``python -m shardplan.cli``: the command line."""

import sys

from shardplan.cli.commands import main

sys.exit(main())
