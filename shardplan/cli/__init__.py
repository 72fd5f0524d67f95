"""The ``shardplan`` command line: :func:`main`.

Every bad input ends as one line on stderr and exit status 2 (never a traceback); results go to stdout,
progress to stderr. :mod:`~shardplan.cli.options` holds what the commands share,
:mod:`~shardplan.cli.commands` the parser and most commands, :mod:`~shardplan.cli.plan` the planning
command, :mod:`~shardplan.cli.pipeline` the stage search on its own.
"""

from shardplan.cli.commands import build_parser, main
from shardplan.cli.options import progress

__all__ = ["main", "build_parser", "progress"]
