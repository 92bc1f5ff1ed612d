"""The DHT side of the swarm: record schema, the experts' compatibility tag, record validators, server
identities, initial peers, and the ``python -m swarm.dht`` bootstrap peer."""
