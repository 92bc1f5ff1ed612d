# diffusion-swarm on CPU: by default the container hosts a span of a model's blocks for a swarm.
#
#   docker build -t diffusion-swarm .
#   docker run -d --name swarm-server -p 31337:31337 -v swarm-data:/data \
#       -e SWARM_INITIAL_PEERS=/ip4/BOOTSTRAP_IP/tcp/PORT/p2p/PEER_ID -e SWARM_BLOCKS=0:8 \
#       -e SWARM_ANNOUNCE_MADDRS=/ip4/PUBLIC_IP/tcp/31337 diffusion-swarm
#
# Other commands: `docker run IMAGE api ...`, `health ...`, `dht ...` (see docker/entrypoint.sh and
# docs/OPERATIONS.md for every SWARM_* variable).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# CPU torch first, pinned to the version the project is tested with; installing the project next then
# finds torch present instead of pulling the much larger CUDA build.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

WORKDIR /opt/diffusion-swarm
COPY pyproject.toml setup.cfg README.md ./
COPY swarm ./swarm
# The api extra adds fastapi and uvicorn for `api` (python -m swarm.api); the rest comes from setup.cfg.
RUN pip install ".[api]"

COPY docker/entrypoint.sh /usr/local/bin/swarm-entrypoint
RUN chmod 755 /usr/local/bin/swarm-entrypoint \
    && useradd --create-home --uid 1000 swarm \
    && mkdir -p /data && chown swarm /data

USER swarm
# /data keeps the identity key (a stable peer id across restarts) and is where relative paths land.
VOLUME /data
WORKDIR /data
# 31337: the server's libp2p port (SWARM_HOST_MADDRS); 8000: the HTTP API when running `api`.
EXPOSE 31337 8000

ENTRYPOINT ["swarm-entrypoint"]
CMD ["server"]
