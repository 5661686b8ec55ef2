#!/usr/bin/env bash
# Reruns every attack of docs/security.md against the real `fencelock` binary and prints
# the attack table: one line per attack, `ATTACK <item>: <what was tried> -> <outcome>`.
#   ./scripts/attacks.sh              # all of them (a few minutes)
#   ./scripts/attacks.sh tenants      # one file: crates/fencelock-cli/tests/attacks_tenants.rs
# The same tests run in ./scripts/test.sh; this only collects their summary lines.
set -euo pipefail
cd "$(dirname "$0")/.."
pattern="attacks_${1:-*}"
out="$(mktemp)"
trap 'rm -f "$out"' EXIT
# One test at a time: several attacks measure the server's answers under load.
if ! cargo test --locked -p fencelock-cli --test "$pattern" -- --nocapture --test-threads=1 >"$out" 2>&1; then
  cat "$out" >&2
  echo "an attack test failed (output above)" >&2
  exit 1
fi
grep -h '^ATTACK ' "$out" | sort -V
