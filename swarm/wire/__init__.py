"""The wire: what travels between peers (:mod:`~swarm.wire.messages`, :mod:`~swarm.wire.encoding`), how
request streams are read within bounds (:mod:`~swarm.wire.streams`), the services a server declares
(:mod:`~swarm.wire.services`), and one server's RPCs as a caller sees them (:mod:`~swarm.wire.remote`)."""
