"""A server that lists the bottleneck kind in its record and then misapplies it (never a production flag).

Runs the real ``python -m swarm.server`` CLI with one change: its blocks add a bottleneck's weights to the first rows
as if they were a deep prompt (a LoRA is still applied as one). Plain passes stay exact, so only a spot check of an
adapter pass can catch it.
"""
from swarm.adapters import block
from swarm.adapters.kinds import LORA

_enter = block.BlockAdapter.enter


def _as_deep_prompt(self, index, hidden, offset, config):
    if self.kind == LORA:
        return _enter(self, index, hidden, offset, config)
    return block.add_prompt(hidden, self.weights[index], offset), None


block.BlockAdapter.enter = _as_deep_prompt

if __name__ == "__main__":
    from swarm.server.__main__ import main

    main()
