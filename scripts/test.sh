#!/usr/bin/env bash
# Installs everything the test suite needs on a fresh Debian machine (as root), then runs it.
# README's second quickstart command; .ci/run calls exactly this.
# Every install says what it starts, shows what it fetches and sets up as it goes (indented),
# and how long it took: no silent minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
# The suite starts a great many Python processes (services, gateways, python-backend workers,
# load tools). Where the shell sets PYTHONDONTWRITEBYTECODE (this project's dev machines do), each
# of them compiled every module of ours it imports, at every start: importing gateway.main and
# services.base.main took 0.80-1.00 s of CPU so, 0.44-0.58 s with the caches written (three runs
# each, docs/perf/suite-time.md). The caches go to __pycache__/ (git-ignored); the repository
# poll's fingerprint reads only a version folder's files, not its folders (services/base/control.py).
unset PYTHONDONTWRITEBYTECODE
KSERVE_VERSION=0.21.0  # the newest when this was written; the test drives its REST and gRPC clients

# step WHAT CMD...: "test.sh: WHAT", CMD's output indented as it comes, then "WHAT: done in N s"
# (pip's "Requirement already satisfied" lines are left out: they are what a warm machine prints).
step() {
  local what=$1 t0=$SECONDS rc=0
  shift
  echo "test.sh: $what"
  "$@" 2>&1 | { grep --line-buffered -v '^Requirement already satisfied' || true; } | sed -u 's/^/  | /' || rc=$?
  if [ "$rc" = 0 ]; then echo "test.sh: $what: done in $((SECONDS - t0)) s"
  else echo "test.sh: $what: FAILED (exit $rc) after $((SECONDS - t0)) s"; fi
  return "$rc"
}
PIP=(--disable-pip-version-check --progress-bar off)
APT=(-y -q -o Dpkg::Use-Pty=0)

need=()
ldconfig -p 2>/dev/null | grep -q 'libb64.so.0d' || need+=(libb64-0d)   # perf_analyzer
command -v redis-server >/dev/null || need+=(redis-server)               # gateway quota store tests
if [ ${#need[@]} -gt 0 ]; then
  step "apt-get install ${need[*]}" apt-get install "${APT[@]}" "${need[@]}" \
    || { step "apt-get update" apt-get update -q && step "apt-get install ${need[*]}" apt-get install "${APT[@]}" "${need[@]}"; }
fi
step "deploy tools (docker-compose, kubectl, promtool, envoy, ...)" env PYTHON=python3 bash scripts/ci-deps-deploy.sh

step "pip install -e .[dev,torch]" python3 -m pip install "${PIP[@]}" -e ".[dev,torch]"
python3 protos/generate.py --check >/dev/null
# The KServe SDK (issue 18: its REST and gRPC clients against the gateway) lives in a venv of its
# own: it is not a dependency, and installed beside ours it would move pydantic, orjson and psutil.
# About a minute the first time; tests/integration/test_health_and_clients.py uses it.
KSERVE_VENV="${MESHSERVE_CACHE:-$HOME/.cache/meshserve}/kserve-venv"
if [ ! -x "$KSERVE_VENV/bin/python" ] || ! "$KSERVE_VENV/bin/python" -c "import kserve" 2>/dev/null; then
  python3 -m venv "$KSERVE_VENV" \
    && step "kserve SDK venv at $KSERVE_VENV (pip install kserve==$KSERVE_VERSION)" \
      "$KSERVE_VENV/bin/python" -m pip install "${PIP[@]}" "kserve==$KSERVE_VERSION" \
    || echo "test.sh: WARNING: no kserve venv; the KServe SDK test will skip"
fi
[ -x "$KSERVE_VENV/bin/python" ] && export MESHSERVE_KSERVE_PYTHON="$KSERVE_VENV/bin/python"
echo "test.sh: ruff + mypy"
python3 -m ruff check . --quiet
python3 -m mypy
status=0
if [ $# = 0 ]; then
  # The suite in parallel (pytest-xdist, one worker per core; a worker takes a whole test file, so
  # its module fixtures start once, and all of tests/adversarial/ as one unit: one attack at a time,
  # tests/conftest.py:pytest_xdist_make_scheduler), then the tests with a tight latency or rate
  # bound (-m serial) alone, so that no other test's processes share their cores: every process
  # the parallel part started carries MESHSERVE_SUITE_RUN in its environment, and the serial part
  # waits until none is left (tests/support/leftovers.py: at most 30 s, then it lists and kills
  # them) and the parallel part's written files are flushed (sync).
  # Workers: one more than the cores (MESHSERVE_TEST_WORKERS: another number, xdist's -n). The
  # parallel part waits more than it computes (1.27 cores busy of 2 over a whole run), so on CI's 2
  # cores a third worker shortens it: fresh clones here, parallel part 661 s with 2 workers, 598 s
  # with 3, the adversarial chain then the longest unit (docs/perf/suite-time.md, session 19).
  run_token="$$-$(date +%s%N)"
  # (the cores as xdist's -n auto counts them without psutil: the CPUs this process may run on;
  # not nproc, which OMP_NUM_THREADS also moves)
  workers="${MESHSERVE_TEST_WORKERS:-$(python3 -c 'import os; print(len(os.sched_getaffinity(0)) + 1)')}"
  MESHSERVE_SUITE_RUN="$run_token" python3 -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder -m "not serial" \
    || status=$?
  python3 -m tests.support.leftovers "$run_token" --timeout 30 || true
  sync
  python3 -m pytest -m serial || status=$?
else
  python3 -m pytest "$@" || status=$?
fi
# The compose stack in a real Docker engine (issue 22; ~2 min with its images built, ~7 min
# without), after a full green run where the engine is installed. MESHSERVE_SKIP_COMPOSE_E2E=1
# leaves it out. Its log goes to /tmp: deploy/compose-e2e.log is the committed record.
if [ "$status" = 0 ] && [ $# = 0 ] && command -v dockerd >/dev/null && [ -z "${MESHSERVE_SKIP_COMPOSE_E2E:-}" ]; then
  echo "test.sh: scripts/compose-e2e.sh (dockerd is installed)"
  COMPOSE_E2E_LOG=/tmp/compose-e2e.log bash scripts/compose-e2e.sh || status=$?
fi
exit "$status"
