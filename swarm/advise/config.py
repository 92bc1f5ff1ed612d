"""The advise command's names and bounds: plain constants, so that ``python -m swarm.advise --help`` loads no torch
or hivemind (``swarm.advise.advice`` and ``swarm.advise.proposals`` do, when a question is asked)."""
from __future__ import annotations

TASK = "host-blocks"  # HostBlocksTask.name (tests/test_advise.py checks they agree)
DEFAULT_ADAPTER = f"best:{TASK}"  # swarm.reports.records.BEST + TASK: the version trusted auditors scored best
NONE = "none"  # --adapter none: the rule alone
MAX_BLOCKS = 1024  # a coverage given by hand: blocks
MAX_COUNT = 1_000_000  # and servers per block
