#!/usr/bin/env bash
# Entry point of the diffusion-swarm image: a server by default, any swarm command by name.
#
#   docker run IMAGE                        python -m swarm.server, configured by the SWARM_* variables below
#   docker run IMAGE server --blocks 0:16   the same, command-line options added last (they win)
#   docker run IMAGE api --port 8000 ...    python -m swarm.api      (OpenAI-style HTTP API)
#   docker run IMAGE health ...             python -m swarm.health   (health map)
#   docker run IMAGE dht ...                python -m swarm.dht      (bootstrap peer)
#   docker run IMAGE healthcheck            the image's HEALTHCHECK: swarm.health over SWARM_INITIAL_PEERS
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
#   SWARM_THREADS           torch CPU threads                       (default: half of the container's CPUs)
#   SWARM_HOST_MADDRS       multiaddrs to listen on, space-separated     (default: /ip4/0.0.0.0/tcp/31337)
#   SWARM_ANNOUNCE_MADDRS   public multiaddrs to announce, e.g. /ip4/203.0.113.7/tcp/31337
#   SWARM_IDENTITY_PATH     key file giving a stable peer id               (default: /data/identity.key)
#
# Started as root (the image's default), it gives /data to the swarm user, then runs the command as that user:
# a bind-mounted host directory owned by root would otherwise be read-only for it. Started as another user
# (docker run --user UID:GID), it only checks that /data is writable. SWARM_DATA_DIR moves /data.
set -euo pipefail

SWARM_USER=swarm
DATA_DIR="${SWARM_DATA_DIR:-/data}"
AS_SWARM_USER=()  # the prefix that runs a command as the swarm user: setpriv when started as root

# Make the data directory writable by whoever runs the commands (exit 2 with one line if it cannot be).
prepare_data_dir() {
    if [[ "$(id -u)" == 0 ]]; then
        mkdir -p "$DATA_DIR"
        find "$DATA_DIR" -maxdepth 1 ! -user "$SWARM_USER" -exec chown "$SWARM_USER:" {} + 2>/dev/null \
            || echo "warning: could not give everything in $DATA_DIR to $SWARM_USER (read-only mounts?)" >&2
        export HOME="/home/$SWARM_USER"
        AS_SWARM_USER=(setpriv --reuid="$SWARM_USER" --regid="$(id -g "$SWARM_USER")" --init-groups)
    elif [[ ! -w "$DATA_DIR" ]]; then
        echo "Error: $DATA_DIR is not writable by uid $(id -u): chown the mounted directory to $(id -u)," \
             "or start the container without --user (it then fixes the owner itself)" >&2
        exit 2
    fi
}

run_as_swarm_user() {
    exec "${AS_SWARM_USER[@]}" "$@"
}

# The server's options from the SWARM_* variables, into the array SERVER_OPTIONS.
server_options() {
    SERVER_OPTIONS=(--model "${SWARM_MODEL:-default}" --identity-path "${SWARM_IDENTITY_PATH:-$DATA_DIR/identity.key}")
    if [[ -n "${SWARM_BLOCKS:-}" ]]; then SERVER_OPTIONS+=(--blocks "$SWARM_BLOCKS"); fi
    if [[ -n "${SWARM_NUM_BLOCKS:-}" ]]; then SERVER_OPTIONS+=(--num-blocks "$SWARM_NUM_BLOCKS"); fi
    if [[ -n "${SWARM_PUBLIC_NAME:-}" ]]; then SERVER_OPTIONS+=(--public-name "$SWARM_PUBLIC_NAME"); fi
    if [[ -n "${SWARM_DHT_PREFIX:-}" ]]; then SERVER_OPTIONS+=(--dht-prefix "$SWARM_DHT_PREFIX"); fi
    if [[ -n "${SWARM_THROUGHPUT:-}" ]]; then SERVER_OPTIONS+=(--throughput "$SWARM_THROUGHPUT"); fi
    if [[ -n "${SWARM_THREADS:-}" ]]; then SERVER_OPTIONS+=(--threads "$SWARM_THREADS"); fi
    for addr in ${SWARM_HOST_MADDRS:-/ip4/0.0.0.0/tcp/31337}; do SERVER_OPTIONS+=(--host-maddrs "$addr"); done
    for addr in ${SWARM_ANNOUNCE_MADDRS:-}; do SERVER_OPTIONS+=(--announce-maddrs "$addr"); done
}

# HEALTHCHECK: healthy (0) while the model is fully served in the swarm joined through SWARM_INITIAL_PEERS;
# any other exit of swarm.health is unhealthy (1: Docker reserves 2). Without initial peers there is nothing to ask.
healthcheck() {
    if [[ -z "${SWARM_INITIAL_PEERS:-}" ]]; then
        echo "no SWARM_INITIAL_PEERS: no swarm to check"
        exit 0
    fi
    local options=(--model "${SWARM_MODEL:-default}")
    if [[ -n "${SWARM_DHT_PREFIX:-}" ]]; then options+=(--dht-prefix "$SWARM_DHT_PREFIX"); fi
    "${AS_SWARM_USER[@]}" python -m swarm.health "${options[@]}" "$@" || exit 1
}

command="${1:-server}"
if [[ $# -gt 0 ]]; then shift; fi
prepare_data_dir
case "$command" in
    server) server_options; run_as_swarm_user python -m swarm.server "${SERVER_OPTIONS[@]}" "$@" ;;
    -*) server_options; run_as_swarm_user python -m swarm.server "${SERVER_OPTIONS[@]}" "$command" "$@" ;;
    api) run_as_swarm_user python -m swarm.api "$@" ;;
    health) run_as_swarm_user python -m swarm.health "$@" ;;
    dht | bootstrap) run_as_swarm_user python -m swarm.dht "$@" ;;
    healthcheck) healthcheck "$@" ;;
    *) run_as_swarm_user "$command" "$@" ;;
esac
