#!/usr/bin/env bash
# The one test command: installs what the tests need (when missing) and runs them all.
#   ./scripts/test.sh            # everything
#   ./scripts/test.sh -p fencelock-core   # extra args go to `cargo nextest run`
#                                         # (and the build); doctests only with none
set -euo pipefail
cd "$(dirname "$0")/.."

# Each phase's wall time goes to stdout and, when FENCELOCK_PHASE_LOG names a file
# (.ci/run sets it), to that file for the run's phase table.
phase() {
  local name=$1 start=$SECONDS rc
  shift
  # In a subshell with errexit on: a failing step inside a function phase stops it.
  set +e
  (set -e; "$@")
  rc=$?
  set -e
  echo "test.sh: phase '$name' took $((SECONDS - start)) s (rc $rc)"
  [ -z "${FENCELOCK_PHASE_LOG:-}" ] || printf '%s\t%s\t%s\n' "$name" "$((SECONDS - start))" "$rc" >>"$FENCELOCK_PHASE_LOG"
  return "$rc"
}

install_all() {

need_apt=()
command -v cc >/dev/null || need_apt+=(gcc)
command -v curl >/dev/null || need_apt+=(curl)
command -v openssl >/dev/null || need_apt+=(openssl)  # TLS tests make a test CA
# The dashboard's browser test (crates/fencelock-server/tests/e2e_dashboard.rs)
# drives Debian's Chromium with playwright-core under Node.js.
command -v node >/dev/null || need_apt+=(nodejs)
command -v npm >/dev/null || need_apt+=(npm)
[ -x /usr/bin/chromium ] || need_apt+=(chromium)
# The Python client example of docs/clients.md (crates/fencelock-cli/tests/clients.rs).
command -v python3 >/dev/null || need_apt+=(python3)
# The Go client example (same test): built offline with the standard library only.
command -v go >/dev/null || need_apt+=(golang-go)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}"
  else
    echo "missing: ${need_apt[*]} (install them, or run as root to install automatically)" >&2
    exit 1
  fi
fi
# Its one library, `requests`: from pip where python3 is pip's (a virtualenv, pyenv),
# else Debian's package for the system python3.
if ! python3 -c 'import requests' 2>/dev/null; then
  python3 -m pip install --quiet requests 2>/dev/null ||
    { [ "$(id -u)" = 0 ] && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-requests; } ||
    { echo "missing: the Python package requests (pip install requests)" >&2; exit 1; }
fi
# Tests start their own throwaway PostgreSQL, MariaDB, Redis, etcd and ZooKeeper servers
# (fencelock-testkit): the backends' conformance suite and the benchmark smoke run.
./scripts/install-peers.sh
if ! command -v cargo >/dev/null; then
  echo "cargo not found: install Rust (https://rustup.rs) first" >&2
  exit 1
fi

e2e=crates/fencelock-server/tests/e2e
if [ ! -d "$e2e/node_modules" ]; then
  # Exactly the versions in package-lock.json; playwright-core downloads no browser.
  (cd "$e2e" && npm ci --no-audit --no-fund)
fi
# The test runner: every test in its own process, several binaries at once
# (.config/nextest.toml). From crates.io when missing.
if ! cargo nextest --version >/dev/null 2>&1; then
  cargo install cargo-nextest --locked
fi
}
phase install install_all

# Built once here, so the build's minutes and the tests' minutes are separate lines
# of the phase table. With no arguments the tests then run from the build's list of
# binaries without calling cargo again, so cargo's lock on the target directory is
# free while they run: .ci/run's lints use it then, in the same target directory,
# reusing the build's dependencies (half the CPU of a lint build of their own).
# FENCELOCK_BUILT_MARKER, when set, names a file touched once the build is done.
no_tests_warn=(--no-tests=warn)
if [ $# -eq 0 ]; then
  nextest_dir="${CARGO_TARGET_DIR:-target}/nextest"
  build_and_list() {
    mkdir -p "$nextest_dir"
    cargo nextest list --workspace --locked --list-type binaries-only \
      --message-format json >"$nextest_dir/binaries-metadata.json"
    cargo metadata --format-version 1 --locked --all-features --no-deps \
      >"$nextest_dir/cargo-metadata.json"
  }
  phase build build_and_list
  [ -z "${FENCELOCK_BUILT_MARKER:-}" ] || touch "$FENCELOCK_BUILT_MARKER"
  # No retries: a test that fails once under load is a defect to fix, not to rerun.
  phase tests cargo nextest run "${no_tests_warn[@]}" \
    --binaries-metadata "$nextest_dir/binaries-metadata.json" \
    --cargo-metadata "$nextest_dir/cargo-metadata.json"
else
  phase build cargo test --workspace --locked --no-run "$@"
  phase tests cargo nextest run --workspace --locked "${no_tests_warn[@]}" "$@"
fi
if [ $# -eq 0 ]; then
  # Doc examples: nextest does not run doctests.
  phase doctests cargo test --workspace --locked --doc
fi
slowest=target/nextest/default/junit.xml
[ ! -f "$slowest" ] || ./scripts/slowest-tests.py "$slowest" 15

# The benchmark harness against real peers, tiny and short (seconds): proves it works.
# This and the fuzz run: only with no extra arguments (a filtered run skips them).
if [ $# -eq 0 ]; then
  target="${CARGO_TARGET_DIR:-target}"
  # `cargo test --workspace` has just built both binaries (their crates' integration
  # tests run them); build them only if they are missing.
  if [ ! -x "$target/debug/fencelock" ] || [ ! -x "$target/debug/fencelock-bench" ]; then
    cargo build --locked -p fencelock-cli -p fencelock-bench
  fi
  smoke_out="$(mktemp -d)"
  phase bench-smoke "$target/debug/fencelock-bench" run --smoke --fencelock-bin "$target/debug/fencelock" --out "$smoke_out" >/dev/null
  rm -rf "$smoke_out"

  # Every fuzz harness already ran above on stable (crates/fencelock-fuzz/tests/seeds.rs:
  # its seeds, every truncation, random and mutated bytes). The coverage-guided run
  # (nightly + cargo-fuzz, installed when missing) needs a release build of the whole
  # server of its own, about 6 CPU-minutes, a fifth of CI's budget on two loaded cores:
  # it runs when asked, FENCELOCK_FUZZ_SECONDS=N seconds per target (CI: 0);
  # longer runs: scripts/fuzz.sh 3600.
  fuzz_seconds="${FENCELOCK_FUZZ_SECONDS:-0}"
  if [ "$fuzz_seconds" != 0 ]; then
    phase fuzz ./scripts/fuzz.sh "$fuzz_seconds"
  fi
fi
