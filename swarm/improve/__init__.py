"""The trainer role: ``python -m swarm.improve`` trains an adapter through the swarm from a data source, round after
round, and publishes a new version whenever its own held-out figure beats the one it published last
(docs/TRAINING.md, "The self-improving loop")."""
