#!/bin/bash
# Envoy's entrypoint in deploy/compose.yaml: Envoy itself exits at once on SIGTERM and cuts
# every request in flight. This wrapper turns `docker compose stop` into a drain: on SIGTERM
# it asks the admin interface (127.0.0.1:9901, inside the container) for a graceful listener
# drain (HTTP/1.1 answers get `Connection: close`, HTTP/2 connections GOAWAY), waits until no
# request is active on the http and grpc listeners (at most ENVOY_DRAIN_TIMEOUT_S, 25 s by
# default: within compose's 30 s stop_grace_period), then stops Envoy.
# Runs with the image's bash only (no curl in the Envoy image): HTTP over /dev/tcp.
set -u

admin() {  # METHOD PATH -> the admin interface's reply (status line, headers, body)
  exec 3<>/dev/tcp/127.0.0.1/9901 || return 1
  printf '%s %s HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: 0\r\n\r\n' "$1" "$2" >&3
  cat <&3
  exec 3<&-
}

in_flight() {  # requests active on the listeners of envoy.yaml (stat prefixes http, grpc)
  admin GET '/stats?filter=downstream_rq_active' 2>/dev/null \
    | awk -F': ' '/^http\.(http|grpc)\.downstream_rq_active: / {n += $2} END {print n + 0}'
}

drain() {
  echo "envoy-entrypoint: SIGTERM, draining listeners" >&2
  admin POST '/drain_listeners?graceful' >/dev/null 2>&1
  local deadline=$((SECONDS + ${ENVOY_DRAIN_TIMEOUT_S:-25})) active
  while active=$(in_flight) && [ "$active" != 0 ] && [ "$SECONDS" -lt "$deadline" ]; do
    sleep 0.2
  done
  echo "envoy-entrypoint: ${active:-?} requests in flight, stopping envoy" >&2
  kill -TERM "$child" 2>/dev/null
}

# The official image's own entrypoint drops root (ENVOY_UID); keep it where it exists.
if [ -x /docker-entrypoint.sh ]; then
  set -- /docker-entrypoint.sh "$@"
fi
"$@" &
child=$!
trap drain TERM INT
# `wait` returns early (status > 128) when the trap runs; wait again until Envoy has exited.
while :; do
  wait "$child"
  status=$?
  kill -0 "$child" 2>/dev/null || break
done
if [ "$status" -gt 128 ]; then  # interrupted by the trap while Envoy was exiting: its own status
  wait "$child" 2>/dev/null
  last=$?
  [ "$last" = 127 ] || status=$last
fi
exit "$status"
