# diffusion-swarm on CPU: by default the container hosts a span of a model's blocks for a swarm.
#
#   docker build -t diffusion-swarm .
#   docker run -d --name swarm-server -p 31337:31337 -v swarm-data:/data \
#       -e SWARM_INITIAL_PEERS=/ip4/BOOTSTRAP_IP/tcp/PORT/p2p/PEER_ID -e SWARM_BLOCKS=0:8 \
#       -e SWARM_ANNOUNCE_MADDRS=/ip4/PUBLIC_IP/tcp/31337 diffusion-swarm
#
# Other commands: `docker run IMAGE api ...`, `health ...`, `dht ...` (see docker/entrypoint.sh and
# docs/OPERATIONS.md for every SWARM_* variable). tests/test_docker.py checks this file without a Docker daemon.

# The Python the project is tested with, on Debian 12. A tag can be rebuilt upstream; to pin the exact image,
# build with its digest: --build-arg PYTHON_IMAGE=python:3.11.7-slim-bookworm@sha256:<digest from
# `docker buildx imagetools inspect python:3.11.7-slim-bookworm`>.
ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm
FROM ${PYTHON_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# tini runs as PID 1: it forwards signals to the command and reaps orphaned processes. (The libp2p daemons die
# with their parent by themselves: swarm/dht/node.py.)
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini=0.19.0-1+b3 \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/diffusion-swarm
# Every version is pinned in docker/constraints.txt (made by docker/lock.py from the tested environment). torch
# comes first, alone, from PyTorch's CPU-only index: the default torch wheel is the much larger CUDA build.
COPY docker/constraints.txt ./docker/constraints.txt
RUN pip install --no-deps torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml setup.cfg README.md ./
COPY swarm ./swarm
# The api extra adds fastapi and uvicorn for `api` (python -m swarm.api); the rest comes from setup.cfg.
RUN pip install -c docker/constraints.txt ".[api]"

COPY docker/entrypoint.sh /usr/local/bin/swarm-entrypoint
RUN chmod 755 /usr/local/bin/swarm-entrypoint \
    && useradd --create-home --uid 1000 swarm \
    && mkdir -p /data && chown swarm:swarm /data

# /data keeps the identity key (a stable peer id across restarts) and is where relative paths land. The
# entrypoint starts as root only to make a bind-mounted /data writable by the swarm user (uid 1000), then runs
# every command as that user; with `docker run --user UID:GID` it checks that /data is writable instead.
VOLUME /data
WORKDIR /data
# 31337: the server's libp2p port (SWARM_HOST_MADDRS); 8000: the HTTP API when running `api`.
EXPOSE 31337 8000

# Healthy while the model is fully served in the swarm joined through SWARM_INITIAL_PEERS (python -m swarm.health:
# exit 0); every other exit code (1 blocks unserved, 3 swarm unreachable, ...) marks the container unhealthy.
HEALTHCHECK --interval=60s --timeout=45s --start-period=180s --retries=3 CMD ["swarm-entrypoint", "healthcheck"]

ENTRYPOINT ["tini", "--", "swarm-entrypoint"]
CMD ["server"]
