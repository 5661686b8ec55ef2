#!/usr/bin/env bash
# Usage: scripts/cpu-per-pair.sh TARGET — runs W2 (c=16 then c=64) against TARGET with the release
# build, samples the CPU time of the server and of the harness for 4 s inside the c=16 run, and
# prints CPU microseconds per acquire+release pair for each. Needs target/release built;
# FLBIN=path runs another server binary (to compare two builds).
set -u
cd "$(dirname "$0")/.."
t=${1:-fencelock}
out=/tmp/cpp-$t; rm -rf $out
target/release/fencelock-bench run --fencelock-bin ${FLBIN:-target/release/fencelock} --out $out --targets $t --workloads w2 --seconds 6 --warmup 1 > $out.log 2>&1 &
sleep 3
b=$(pgrep -x fencelock-bench | head -1); s=$(pgrep -f " serve --listen " | head -1)
tick=$(getconf CLK_TCK)
cpu() { awk '{print $14+$15}' /proc/$1/stat 2>/dev/null || echo 0; }
b0=$(cpu $b); s0=$(cpu $s); sleep 4; b1=$(cpu $b); s1=$(cpu $s)
wait
python3 - "$out" "$b0" "$b1" "$s0" "$s1" "$tick" <<'PY'
import json,sys
out,b0,b1,s0,s1,tick=sys.argv[1],*map(float,sys.argv[2:])
rs=[json.loads(l) for l in open(out+'/results.jsonl')]
r=rs[0]  # c=16 runs first; the sample window (3..7s) falls in it
pps=r['pairs_per_s']
print(f"{r['target']} c={r['clients']} {pps:.0f} pairs/s; server {(s1-s0)/tick/4*1e6/pps:.1f} µs CPU/pair, bench {(b1-b0)/tick/4*1e6/pps:.1f} µs CPU/pair; all: "+", ".join(f"c={x['clients']}:{x['pairs_per_s']:.0f}" for x in rs))
PY
