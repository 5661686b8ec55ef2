#!/usr/bin/env bash
# Cluster chaos (docs/verification.md, "Cluster chaos"): three real members behind
# per-link proxies, workers following the leader, every fault of
# fencelock_chaos::cluster::Fault as a step, and the history checker.
#   ./scripts/chaos-cluster.sh            # the long run: every fault 3 times, a follower
#                                         # isolated while 25,000 entries are committed
#   ./scripts/chaos-cluster.sh 10         # every fault 10 times
#   ./scripts/chaos-cluster.sh short      # the CI run (< 3 minutes) and the planted bug
#   ./scripts/chaos-cluster.sh divergence # the smallest reproduction of the state machine
#                                         # divergence in docs/verification.md (~2 minutes):
#                                         # a snapshot, then a rolling restart
# FENCELOCK_CHAOS_SEED=N replays a run's random choices. A fenced run that finds a
# violation or misses a progress bound keeps its directory (members' logs and data,
# worker histories) and prints its path.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-3}" in
  short)
    exec cargo test --locked -p fencelock-cli --test chaos_cluster -- --nocapture
    ;;
  divergence)
    FENCELOCK_CHAOS_LONG=1 FENCELOCK_CHAOS_FAULTS=isolate_follower,rolling_restart,rolling_restart,rolling_restart \
      exec cargo test --locked -p fencelock-cli --test chaos_cluster -- --nocapture cluster_chaos_fenced
    ;;
  *[!0-9]*)
    echo "usage: $0 [rounds|short|divergence]" >&2
    exit 2
    ;;
  *)
    FENCELOCK_CHAOS_LONG=1 FENCELOCK_CHAOS_ROUNDS="$1" \
      exec cargo test --locked -p fencelock-cli --test chaos_cluster -- --nocapture cluster_chaos_fenced
    ;;
esac
