#!/usr/bin/env bash
# The full benchmark: fencelock against etcd, ZooKeeper, Redis and PostgreSQL, on this
# machine, in one run (see BENCHMARKS.md). Every peer is started by the harness from
# its Debian package on a random loopback port in a temporary directory, and stopped
# afterwards; nothing depends on services already running.
#   ./scripts/bench.sh                       # everything (about 8 minutes)
#   ./scripts/bench.sh --workloads w2 --targets fencelock,etcd   # a subset
#   OUT=/tmp/b ./scripts/bench.sh            # keep the results in /tmp/b
#   ./scripts/bench.sh --workloads w6,election --targets fencelock,etcd,zookeeper  # issue 22
# Writes OUT/results.jsonl (one JSON line per run), OUT/report.md and OUT/chart.svg.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-peers.sh
cargo build --release --locked -p fencelock-cli -p fencelock-bench
target="${CARGO_TARGET_DIR:-target}"
out="${OUT:-$(mktemp -d)}"
echo "machine: $(nproc) cores, $(uptime)" >&2
"$target/release/fencelock-bench" run --fencelock-bin "$target/release/fencelock" --out "$out" "$@"
echo "results in $out" >&2
