"""A server as it was before records said which per-block adapters a server applies (never a production flag).

Runs the real ``python -m swarm.server`` CLI with two changes: its record lists no adapter kinds (the field did
not exist), and its blocks apply every per-block tensor as a deep prompt (what such a server did with a
bottleneck's weights: added them to the first rows, wrong numbers and no error).
"""
import dataclasses

from swarm.models import modules
from swarm.server import server

_record = server.Server.record


def _record_without_kinds(self):
    return dataclasses.replace(_record(self), adapter_kinds=[])


def _as_deep_prompt(kind, hidden, weights, offset=0):
    return modules.add_prompt(hidden, weights, offset)


server.Server.record = _record_without_kinds
modules.apply_block_adapter = _as_deep_prompt

if __name__ == "__main__":
    from swarm.server.__main__ import main

    main()
