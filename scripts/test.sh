#!/usr/bin/env bash
# The one test command: installs what the tests need (when missing) and runs them all.
#   ./scripts/test.sh            # everything
#   ./scripts/test.sh -p fencelock-core   # extra args go to `cargo test`
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v cc >/dev/null || need_apt+=(gcc)
command -v curl >/dev/null || need_apt+=(curl)
# Tests start their own throwaway PostgreSQL and Redis servers (fencelock-testkit).
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need_apt+=(postgresql)
command -v redis-server >/dev/null || need_apt+=(redis-server)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq "${need_apt[@]}"
  else
    echo "missing: ${need_apt[*]} (install them, or run as root to install automatically)" >&2
    exit 1
  fi
fi
if ! command -v cargo >/dev/null; then
  echo "cargo not found: install Rust (https://rustup.rs) first" >&2
  exit 1
fi

cargo test --workspace --locked "$@"
