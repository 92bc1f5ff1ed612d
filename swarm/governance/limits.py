"""Plain values of governance (the bounds of its settings, the decisions' names), in a module that imports nothing,
so that the server's and the client's settings and ``python -m swarm.governance`` declare them without loading the
DHT."""

MAX_STALE_AFTER = 7 * 24 * 3600.0  # the fail-safe bound (governance_stale_after) is at most a week
HALT, RESUME = "halt", "resume"  # the two decisions a governance record holds
