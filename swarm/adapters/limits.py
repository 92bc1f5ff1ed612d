"""Plain values of adapter sharing, in a module that imports nothing, so that ``python -m swarm.finetune publish``
declares its options without loading the DHT."""

PUBLISH_LIFETIME = 7 * 24 * 3600.0  # seconds a published adapter record lives; publishing again refreshes it
