#!/usr/bin/env bash
# Reruns every attack of docs/security.md against the real server and prints the
# attack table: one line per attack, `ATTACK <item>: <what was tried> -> <outcome>`.
#   ./scripts/attacks.sh              # all of them (a few minutes)
#   ./scripts/attacks.sh tenants      # one file: crates/fencelock-cli/tests/attacks_tenants.rs
# The same tests run in ./scripts/test.sh; this only collects their summary lines.
# The browser test needs Chromium and `npm ci` in crates/fencelock-server/tests/e2e
# (./scripts/test.sh installs both).
set -euo pipefail
cd "$(dirname "$0")/.."
out="$(mktemp)"
trap 'rm -f "$out"' EXIT
run() {
  # One test at a time: several attacks measure the server's answers under load.
  local package=$1
  shift
  if ! cargo test --locked -p "$package" --test it -- "$@" --nocapture --test-threads=1 >>"$out" 2>&1; then
    cat "$out" >&2
    echo "an attack test failed (output above)" >&2
    exit 1
  fi
}
run fencelock-cli "attacks_${1:-}"
if [ $# -eq 0 ]; then
  # The two attacks that are not against the binary: the audit index's heap, counted
  # by an allocator, and a page on another origin in headless Chromium.
  run fencelock-server audit_memory:: e2e_cross_origin::
fi
grep -ho 'ATTACK [0-9].*' "$out" | sort -V
