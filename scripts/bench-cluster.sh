#!/usr/bin/env bash
# The cluster benchmark of BENCHMARKS.md ("Cluster (3 members)"): fencelock-3 against
# etcd-3 and zk-3, W1–W3 three times (the table takes the median of the three runs'
# ratios), then the failover workload once with KILLS leader kills per target, and
# the tables of all of it. Every cluster is started by the harness on loopback ports
# in temporary directories and stopped afterwards.
#   ./scripts/bench-cluster.sh                 # 3 runs + failover (about 10 minutes)
#   RUNS=1 KILLS=3 ./scripts/bench-cluster.sh  # quicker
#   OUT=/tmp/c ./scripts/bench-cluster.sh      # keep everything in /tmp/c
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-peers.sh
cargo build --release --locked -p fencelock-cli -p fencelock-bench
target="${CARGO_TARGET_DIR:-target}"
out="${OUT:-$(mktemp -d)}"
runs="${RUNS:-3}"
kills="${KILLS:-10}"
bench="$target/release/fencelock-bench"
echo "machine: $(nproc) cores, $(uptime)" >&2
results=()
for i in $(seq 1 "$runs"); do
  "$bench" run --fencelock-bin "$target/release/fencelock" --out "$out/run$i" \
    --targets fencelock-3,etcd-3,zk-3 --workloads w1,w2,w3 >/dev/null
  results+=(--results "$out/run$i/results.jsonl")
done
"$bench" run --fencelock-bin "$target/release/fencelock" --out "$out/failover" \
  --targets fencelock-3,etcd-3,zk-3 --workloads failover --kills "$kills" >/dev/null
results+=(--results "$out/failover/results.jsonl")
"$bench" cluster-report "${results[@]}" | tee "$out/cluster.md"
echo "results in $out" >&2
