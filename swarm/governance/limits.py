"""Bounds of the governance settings, in a module that imports nothing, so that the server's and the client's
settings declare them without loading the DHT."""

MAX_STALE_AFTER = 7 * 24 * 3600.0  # the fail-safe bound (governance_stale_after) is at most a week
