#!/usr/bin/env bash
# Runs every cargo-fuzz target (fuzz/fuzz_targets) for N seconds each and fails on
# any crash, hang or out-of-memory. Needs the nightly toolchain; installs
# cargo-fuzz if it is missing.
#
#   scripts/fuzz.sh              # 20 s per target
#   scripts/fuzz.sh 3600         # an hour per target (before a release)
#   scripts/fuzz.sh 60 log_dir   # only some targets
#   scripts/fuzz.sh --planted 20 # each target with its planted bug on: every one
#                                # must be found (a crash) within the time
#   scripts/fuzz.sh --build-only # only the build (.ci/run starts it beside the tests)
#
# Each target starts from fuzz/seeds/<target> (and uses fuzz/dicts/<target>.dict) (committed; written by
# `FENCELOCK_FUZZ_WRITE_SEEDS=1 cargo test -p fencelock-fuzz --test it seeds::`) and
# keeps what it learns in fuzz/corpus/<target> (not committed). A crash leaves its
# input in fuzz/artifacts/<target>/; replay it with
#   cargo +nightly fuzz run <target> fuzz/artifacts/<target>/<file>
# or on stable through the harness function named in fuzz/fuzz_targets/<target>.rs.
# Builds go to $CARGO_TARGET_DIR/fuzz if CARGO_TARGET_DIR is set, else fuzz/target.
set -euo pipefail

planted=0
build_only=0
if [[ "${1:-}" == "--planted" ]]; then
    planted=1
    shift
elif [[ "${1:-}" == "--build-only" ]]; then
    build_only=1
    shift
fi
seconds="${1:-20}"
shift || true
root="$(cd "$(dirname "$0")/.." && pwd)"
fuzz_dir="$root/fuzz"
if [[ $# -gt 0 ]]; then
    targets=("$@")
else
    mapfile -t targets < <(ls "$fuzz_dir/fuzz_targets" | sed 's/\.rs$//' | sort)
fi
target_dir="${CARGO_TARGET_DIR:+$CARGO_TARGET_DIR/fuzz}"
target_dir="${target_dir:-$fuzz_dir/target}"

if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    echo "installing cargo-fuzz ..."
    cargo install cargo-fuzz --locked
fi

# Release build with debug assertions and overflow checks (the core's
# invariant checks in `Core::apply` are debug assertions). No sanitizer: the code
# is safe Rust, and libFuzzer's RSS limit still catches unbounded allocation.
build_flags=(-O -a -s none --target-dir "$target_dir")
start=$(date +%s)
(cd "$fuzz_dir" && cargo +nightly fuzz build "${build_flags[@]}")
build_seconds=$(( $(date +%s) - start ))
if [[ $build_only == 1 ]]; then
    echo "fuzz: built in ${build_seconds}s ($target_dir)"
    exit 0
fi

summary=()
failed=0
for t in "${targets[@]}"; do
    corpus="$fuzz_dir/corpus/$t"
    # A planted bug must be found from the seeds alone, not from what earlier runs
    # learnt: start from an empty corpus.
    [[ $planted == 1 ]] && corpus="$(mktemp -d)"
    artifacts="$fuzz_dir/artifacts/$t"
    mkdir -p "$corpus" "$artifacts"
    seeds=()
    [[ -d "$fuzz_dir/seeds/$t" ]] && seeds=("$fuzz_dir/seeds/$t")
    dict=()
    [[ -f "$fuzz_dir/dicts/$t.dict" ]] && dict=(-dict="$fuzz_dir/dicts/$t.dict")
    log="$(mktemp)"
    t0=$(date +%s)
    set +e
    (
        cd "$fuzz_dir"
        if [[ $planted == 1 ]]; then export FENCELOCK_FUZZ_PLANT="$t"; fi
        cargo +nightly fuzz run "${build_flags[@]}" "$t" "$corpus" "${seeds[@]}" -- \
            -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
            -print_final_stats=1 -artifact_prefix="$artifacts/" "${dict[@]}"
    ) >"$log" 2>&1
    rc=$?
    set -e
    took=$(( $(date +%s) - t0 ))
    runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
    if [[ -z "$runs" ]]; then
        runs=$(grep -oE '^#[0-9]+' "$log" | tail -1 | tr -d '#')
    fi
    crash=$(grep -oE "(crash|leak|timeout|oom|slow-unit)-[0-9a-f]+" "$log" | tail -1 || true)
    crashes=0
    [[ $rc -ne 0 ]] && crashes=1
    if [[ $planted == 1 ]]; then
        if [[ $rc -ne 0 ]] && grep -q "planted bug reached in $t" "$log"; then
            status="found planted bug"
            mkdir -p "$fuzz_dir/planted/$t"
            cp "$artifacts/$crash" "$fuzz_dir/planted/$t/"
        else
            status="MISSED planted bug"
            failed=1
            tail -20 "$log"
        fi
    elif [[ $rc -ne 0 ]]; then
        status="CRASH ${crash:-exit $rc} (fuzz/artifacts/$t/)"
        failed=1
        grep -E "panicked|ERROR|SUMMARY" -A4 "$log" | head -30
    else
        status=ok
    fi
    summary+=("$(printf '%-14s %10s %8s %8s  %s' "$t" "${runs:-?}" "$took" "$crashes" "$status")")
    rm -f "$log"
    [[ $planted == 1 ]] && rm -rf "$corpus"
done

echo
echo "fuzz: build ${build_seconds}s, ${seconds}s per target$([[ $planted == 1 ]] && echo ', planted bugs on')"
printf '%-14s %10s %8s %8s  %s\n' target runs seconds crashes status
printf '%s\n' "${summary[@]}"
echo "total wall time: $(( $(date +%s) - start ))s"
exit $failed
