"""Auditors: standing peers that check servers on a schedule and publish signed reports (issues 39 and 48).

* :mod:`swarm.audit.auditor`: one audit round (from a traffic identity that is not the auditor's, kept across rounds
  like a long-lived client's; whole generations through every online server
  as a client runs them, with caches, head queries and adapters where the server offers them, a random sample of every
  kind of call re-executed on the auditor's own copy of the blocks; with ``--score-adapters``, each published adapter
  scored on held-out problems through the swarm) and the loop of rounds.
* :mod:`swarm.audit.inbox`: clients' saved calls (``--evidence-dir``), recomputed each round; a server proven to
  have signed a wrong answer fails (issue 55).
* ``python -m swarm.audit``: the command (docs/AUDIT.md).

The auditor is a client of the swarm: it imports :mod:`swarm.client`. The report it publishes, and the readers'
``AuditBook``, live below the client in :mod:`swarm.reports.records`, so the client never imports this package.
Nothing is imported here, so the command's ``--help`` loads neither torch nor hivemind.
"""
