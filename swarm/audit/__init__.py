"""Auditors: standing peers that check servers on a schedule and publish signed reports (issue 39).

* :mod:`swarm.audit.records`: the report (per server: checks passed and failed with their times, the last
  failure's reason, measured throughput and round trip against what the server announces), its strict bounded
  encoding, and where it lives on the DHT: the auditor's Ed25519 slot under ``{prefix}.audits.{KEY}``. Readers
  (clients, ``swarm.health``) trust only the auditors they name; per published adapter, its measured score on held-out
  tasks (``adapter="best:TASK"``).
* :mod:`swarm.audit.auditor`: one audit round (a challenge per online server, shaped like a client's forward call,
  compared with the auditor's own copy of the blocks; with ``--score-adapters``, each published adapter scored on
  held-out problems through the swarm) and the loop of rounds.
* ``python -m swarm.audit``: the command (docs/AUDIT.md).

Nothing is imported here, so the command's ``--help`` loads neither torch nor hivemind.
"""
