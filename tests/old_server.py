"""A server as it was before records said which per-block adapters a server applies (never a production flag).

Runs the real ``python -m swarm.server`` CLI with two changes: its record lists no adapter kinds (the field did
not exist), and its blocks apply every per-block tensor but a LoRA as a deep prompt (what such a server did with a
bottleneck's weights: added them to the first rows, wrong numbers and no error; tests/misapplying_server.py).
"""
import dataclasses

import misapplying_server  # noqa: F401  (imported for its patch of the blocks; run as a script, tests/ is on the path)

from swarm.server import server

_record = server.Server.record


def _record_without_kinds(self):
    return dataclasses.replace(_record(self), adapter_kinds=[])


server.Server.record = _record_without_kinds

if __name__ == "__main__":
    from swarm.server.__main__ import main

    main()
