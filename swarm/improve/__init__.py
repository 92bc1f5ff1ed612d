"""The trainer role: ``python -m swarm.improve`` trains an adapter through the swarm from a data source, round after
round, and publishes a new version whenever its own held-out figure beats the one it published last
(docs/TRAINING.md, "The self-improving loop").

The demonstration's plot needs the plot extra (``pip install -e ".[plot]"``: matplotlib); a ``datasets:NAME`` source
needs the data extra (``pip install -e ".[data]"``: Hugging Face's datasets)."""
