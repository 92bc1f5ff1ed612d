"""Adapters: what fine-tuning learns and how the model applies it, in two layers.

Low (below the wire, so that requests can carry it): the kinds' names (:mod:`~swarm.adapters.kinds`), the per-block
value :class:`~swarm.adapters.block.BlockAdapter` with its maths, and the LoRA packing (:mod:`~swarm.adapters.lora`).
High (above the DHT): the client's trainable adapters and their files (:mod:`~swarm.adapters.adapter`) and their
publication (:mod:`~swarm.adapters.sharing`). Nothing is imported here, so the low modules stay light.
"""
