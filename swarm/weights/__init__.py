"""Weights from the swarm: a model named by the SHA-256 of its manifest, mirrored by the servers that hold it.

* :mod:`~swarm.weights.manifest`: what a model is, byte for byte (config, tokenizer files, every tensor's
  shape, dtype, byte range and part hashes); its own SHA-256 is the model id.
* :mod:`~swarm.weights.records`: the DHT entries: names published in an Ed25519 slot, and the peers serving a
  model id (with the tensors each holds).
* :mod:`~swarm.weights.holdings`: what a server holds of its model (all of a directory, or what it fetched).
* :mod:`~swarm.weights.wire` and :mod:`~swarm.weights.service`: the RPC that serves byte ranges of held files,
  bounded per peer, in time and in bandwidth.
* :mod:`~swarm.weights.cache` and :mod:`~swarm.weights.fetch`: a local copy written part by checked part, from
  several peers at once, resumed after a crash.
* :mod:`~swarm.weights.source`: the resolver that lets ``--model ID`` (or a published name) name such a model
  wherever a model is named (``swarm.models.loading.resolve_model``).
"""
