#!/usr/bin/env bash
# The one test command: installs what the tests need (when missing) and runs them all.
#   ./scripts/test.sh            # everything
#   ./scripts/test.sh -p fencelock-core   # extra args go to `cargo test`
set -euo pipefail
cd "$(dirname "$0")/.."

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

start=$SECONDS
cargo test --workspace --locked "$@"
echo "test.sh: cargo test took $((SECONDS - start)) s"

# The benchmark harness against real peers, tiny and short (seconds): proves it works.
# This and the fuzz run: only with no extra arguments (a filtered `cargo test` run skips it).
if [ $# -eq 0 ]; then
  target="${CARGO_TARGET_DIR:-target}"
  # `cargo test --workspace` has just built both binaries (their crates' integration
  # tests run them); build them only if they are missing.
  if [ ! -x "$target/debug/fencelock" ] || [ ! -x "$target/debug/fencelock-bench" ]; then
    cargo build --locked -p fencelock-cli -p fencelock-bench
  fi
  smoke_out="$(mktemp -d)"
  "$target/debug/fencelock-bench" run --smoke --fencelock-bin "$target/debug/fencelock" --out "$smoke_out" >/dev/null
  rm -rf "$smoke_out"
  echo "test.sh: benchmark smoke done at $SECONDS s"

  # A short fuzz run of every decoder and of the core (nightly + cargo-fuzz, installed
  # when missing); longer runs: scripts/fuzz.sh 3600. FENCELOCK_FUZZ_SECONDS=0 skips it.
  fuzz_seconds="${FENCELOCK_FUZZ_SECONDS:-10}"
  if [ "$fuzz_seconds" != 0 ]; then
    start=$SECONDS
    ./scripts/fuzz.sh "$fuzz_seconds"
    echo "test.sh: fuzz took $((SECONDS - start)) s"
  fi
fi
