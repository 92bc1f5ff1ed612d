"""A server that lists the bottleneck kind in its record and then misapplies it (never a production flag).

Runs the real ``python -m swarm.server`` CLI with one change: its blocks add a bottleneck's weights to the first rows
as if they were a deep prompt. Plain passes stay exact, so only a spot check of an adapter pass can catch it.
"""
from swarm.models import modules


def _as_deep_prompt(kind, hidden, weights, offset=0):
    return modules.add_prompt(hidden, weights, offset)


modules.apply_block_adapter = _as_deep_prompt

if __name__ == "__main__":
    from swarm.server.__main__ import main

    main()
