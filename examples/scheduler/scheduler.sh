#!/usr/bin/env bash
# A job scheduler meant to run under `fencelock elect`: only the leader runs jobs, and
# every result goes to a fenced store with the leader's term as the fence, so a
# replica that lost leadership (paused, partitioned, killed mid-write) cannot
# overwrite what a newer leader did.
#
#   fencelock elect scheduler "$(hostname)" --ttl 5s -- scheduler.sh run STATE_DIR [JOBS]
#   scheduler.sh commit STATE_DIR JOB FENCE   # one fenced write, as the leader makes it
#
# The store is STATE_DIR/results/JOB plus STATE_DIR/fence (the largest fence seen);
# a commit holds STATE_DIR/lock (flock) so its check and its write are one step.
# STATE_DIR/events logs each leader's start and each commit, in order.
# Exit codes of `commit`: 0 written or already done, 3 refused (stale fence).
set -euo pipefail

usage() {
    echo "usage: $0 run STATE_DIR [JOBS] | $0 commit STATE_DIR JOB FENCE" >&2
    exit 2
}

# commit STATE_DIR JOB FENCE: writes JOB's result unless FENCE is older than the
# store's fence (then exit 3). A job already done is left as it is: each runs once.
commit() {
    local state=$1 job=$2 fence=$3
    [[ $fence =~ ^[0-9]+$ ]] || { echo "fence must be a number, not ${fence@Q}" >&2; exit 2; }
    mkdir -p "$state/results"
    (
        flock 9
        local last=0
        [[ -s $state/fence ]] && last=$(<"$state/fence")
        if (( fence < last )); then
            echo "refused: job $job with fence $fence, the store has seen $last" >&2
            exit 3
        fi
        echo "$fence" > "$state/fence"
        [[ -e $state/results/$job ]] && exit 0
        echo "job $job done by ${FENCELOCK_VALUE:-?} at term $fence" > "$state/results/$job"
        echo "commit $job $fence ${FENCELOCK_VALUE:-?}" >> "$state/events"
    ) 9>>"$state/lock"
}

run() {
    local state=$1 jobs=${2:-10}
    : "${FENCELOCK_TERM:?run this under fencelock elect}"
    mkdir -p "$state/results"
    # The process group `fencelock elect` made for this command is this shell's.
    (flock 9; echo "lead $FENCELOCK_TERM ${FENCELOCK_VALUE:-?} $$" >> "$state/events") 9>>"$state/lock"
    echo "leading at term $FENCELOCK_TERM"
    for ((job = 1; job <= jobs; job++)); do
        [[ -e $state/results/$job ]] && continue
        # The job's work.
        sleep "${SCHEDULER_JOB_SECONDS:-1}"
        commit "$state" "$job" "$FENCELOCK_TERM"
        echo "committed job $job"
    done
    echo "all $jobs jobs done"
}

case ${1:-} in
    run) [[ $# -ge 2 && $# -le 3 ]] || usage; run "$2" "${3:-10}" ;;
    commit) [[ $# -eq 4 ]] || usage; commit "$2" "$3" "$4" ;;
    *) usage ;;
esac
