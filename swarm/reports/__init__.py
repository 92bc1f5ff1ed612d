"""Audit reports: what auditors publish and what their readers make of them, below both (issue 48).

* :mod:`swarm.reports.records`: the signed report (per server: checks passed and failed with their times, the last
  failure's reason, measured throughput and round trip against what the server announces; per published adapter, its
  measured score on held-out tasks), its strict bounded encoding, where it lives on the DHT (the auditor's Ed25519
  slot under ``{prefix}.audits.{KEY}``), and the readers' :class:`~swarm.reports.records.AuditBook` of trusted
  auditors.

The auditor (``swarm.audit``) is a client that writes these; the client, ``swarm.health`` and the web map read them.
Living here, below the client, the records let ``swarm.audit`` import the client without the client importing it
back. Nothing is imported here.
"""
