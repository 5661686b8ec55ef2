#!/usr/bin/env bash
# The stress pass: the whole test suite, several times, while busy loops compete with
# it for the cores (as CI shares its 2 cores with the servers the tests start). A test
# that fails even once here is a defect to fix at its cause (docs/verification.md,
# "The stress pass").
#
#   scripts/stress.sh                 # 5 runs, 2 busy loops
#   scripts/stress.sh 3 2             # 3 runs, 2 busy loops
#   scripts/stress.sh 1 2 --fuzz      # 1 run beside the fuzz build and run as well
#   scripts/stress.sh 5 2 -p fencelock-server   # extra args go to cargo nextest run
#
# Prints, per run, the wall time, the load average and the failed tests, then the
# tests that failed in any run with their count. Exit status 1 if any test failed.
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-5}"
busy="${2:-2}"
shift $(($# < 2 ? $# : 2))
fuzz=0
if [[ "${1:-}" == "--fuzz" ]]; then
  fuzz=1
  shift
fi

cargo test --workspace --locked --no-run "$@" >/dev/null 2>&1 ||
  cargo test --workspace --locked --no-run "$@"

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
}
trap cleanup EXIT
for _ in $(seq "$busy"); do
  (while :; do :; done) &
  pids+=($!)
done
if [[ $fuzz == 1 ]]; then
  (while :; do FENCELOCK_FUZZ_SECONDS=10 ./scripts/fuzz.sh 10 >/dev/null 2>&1 || true; done) &
  pids+=($!)
fi

out="$(mktemp -d)"
declare -A failed_count=()
any=0
for r in $(seq "$runs"); do
  start=$SECONDS
  log="$out/run-$r.log"
  rc=0
  cargo nextest run --workspace --locked --no-tests=warn "$@" >"$log" 2>&1 || rc=$?
  load=$(cut -d' ' -f1-3 /proc/loadavg)
  failures=$(grep -E '^\s+FAIL \[' "$log" | sed -E 's/.*\] +\([^)]*\) +//; s/.*\] +//' | sort -u || true)
  summary=$(grep -E '^\s+Summary' "$log" | tail -1 | sed -E 's/^\s+//')
  echo "run $r: $((SECONDS - start)) s, load $load, rc $rc: $summary"
  while IFS= read -r t; do
    [[ -z "$t" ]] && continue
    echo "  FAILED: $t"
    failed_count["$t"]=$(( ${failed_count["$t"]:-0} + 1 ))
    any=1
  done <<<"$failures"
  if [[ $rc -ne 0 && -z "$failures" ]]; then
    echo "  the run failed without a failed test (build or listing): $log"
    any=1
  fi
done
echo
if [[ $any == 0 ]]; then
  echo "stress: $runs runs with $busy busy loops$([[ $fuzz == 1 ]] && echo ' and the fuzzer'): no test failed"
else
  echo "stress: tests that failed (of $runs runs); logs in $out"
  for t in "${!failed_count[@]}"; do
    echo "  ${failed_count[$t]}  $t"
  done
fi
exit "$any"
