"""Plain values of models named on the swarm, in a module that imports nothing, so that ``python -m swarm.weights``
declares its options without loading the DHT."""

PUBLISH_LIFETIME = 30 * 24 * 3600.0  # seconds a published name lives; publishing again refreshes it
