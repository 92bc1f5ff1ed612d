"""Training the project's own small models (``python -m swarm.train``).

The prose corpus needs the train extra (``pip install -e ".[train]"``: gensim, for its word vectors)."""
