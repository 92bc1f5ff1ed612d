#!/usr/bin/env bash
# Entry point of the diffusion-swarm image: a server by default, any swarm command by name.
#
#   docker run IMAGE                        python -m swarm.server, configured by the SWARM_* variables below
#   docker run IMAGE server --blocks 0:16   the same, command-line options added last (they win)
#   docker run IMAGE api --port 8000 ...    python -m swarm.api      (OpenAI-style HTTP API)
#   docker run IMAGE health ...             python -m swarm.health   (health map)
#   docker run IMAGE dht ...                python -m swarm.dht      (bootstrap peer)
#   docker run IMAGE sh                     anything else runs as given
#
# Server settings from the environment (command-line options given after `server` override them):
#   SWARM_INITIAL_PEERS     bootstrap multiaddrs, space- or comma-separated (read by the server itself)
#   SWARM_MODEL             embedded model name or checkpoint directory          (default: default)
#   SWARM_BLOCKS            span to host as START:END, e.g. 0:16           (default: least-covered span)
#   SWARM_NUM_BLOCKS        span length when SWARM_BLOCKS is unset                (default: whole model)
#   SWARM_PUBLIC_NAME       name shown in the health map
#   SWARM_DHT_PREFIX        DHT namespace of the model                   (default: model directory name)
#   SWARM_THROUGHPUT        announced tokens/s, or auto                                (default: auto)
#   SWARM_HOST_MADDRS       multiaddrs to listen on, space-separated     (default: /ip4/0.0.0.0/tcp/31337)
#   SWARM_ANNOUNCE_MADDRS   public multiaddrs to announce, e.g. /ip4/203.0.113.7/tcp/31337
#   SWARM_IDENTITY_PATH     key file giving a stable peer id               (default: /data/idenset -euo pipefail

run_server() {
    local options=(--model "${SWARM_MODEL:-default}" --identity-path "${SWARM_IDENTITY_PATH:-/data/identity.key}")
    [[ -n "${SWARM_BLOCKS:-}" ]] && options+=(--blocks "$SWARM_BLOCKS")
    [[ -n "${SWARM_NUM_BLOCKS:-}" ]] && options+=(--num-blocks "$SWARM_NUM_BLOCKS")
    [[ -n "${SWARM_PUBLIC_NAME:-}" ]] && options+=(--public-name "$SWARM_PUBLIC_NAME")
    [[ -n "${SWARM_DHT_PREFIX:-}" ]] && options+=(--dht-prefix "$SWARM_DHT_PREFIX")
    [[ -n "${SWARM_THROUGHPUT:-}" ]] && options+=(--throughput "$SWARM_THROUGHPUT")
    for addr in ${SWARM_HOST_MADDRS:-/ip4/0.0.0.0/tcp/31337}; do options+=(--host-maddrs "$addr"); done
    for addr in ${SWARM_ANNOUNCE_MADDRS:-}; do options+=(--announce-maddrs "$addr"); done
    exec python -m swarm.server "${options[@]}" "$@"
}

command="${1:-server}"
[[ $# -gt 0 ]] && shift
case "$command" in
    server) run_server "$@" ;;
    api) exec python -m swarm.api "$@" ;;
    health) exec python -m swarm.health "$@" ;;
    dht | bootstrap) exec python -m swarm.dht "$@" ;;
    -*) run_server "$command" "$@" ;;  # `docker run IMAGE --blocks 0:8`: options for the server
    *) exec "$command" "$@" ;;
esac
