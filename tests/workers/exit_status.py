"""``python exit_status.py ARGS...`` on each rank of a launched world: run ``plait ARGS`` (``plait.cli.main``) and
print the status it exited with, then exit 0. A world whose every rank refuses its input ends at once; a rank that
went on into ``init_process_group`` would wait there for peers that have left, and the launch's timeout fails the
test as a hang."""

import sys

from plait.cli import main

try:
    main(sys.argv[1:])
    status = 0
except SystemExit as exit_:
    status = exit_.code
print(f"plait exited with status {status}")
