"""The DHT side of the swarm: record schema, initial peers, and the ``python -m swarm.dht`` bootstrap peer."""
