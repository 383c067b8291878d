#!/usr/bin/env bash
# A job on the GPU machine that outlives one `run` call (at most 10 minutes each), and the calls that wait for it.
#
#   bash tools/device_job.sh start NAME SCRIPT [ARG...]   copy the tree to $DEVICE_JOBS/NAME/repo, start SCRIPT there
#                                                          under setsid (detached from the call), return at once
#   bash tools/device_job.sh wait NAME SECONDS [TAIL]      wait up to SECONDS for the job's end, print its state and the
#                                                          last TAIL lines (default 20) of its log; exit 0 once it ended
#                                                          with 0, its exit status if it failed, 75 while it runs, 3
#                                                          when this machine never started it
#   bash tools/device_job.sh collect NAME [PATH...]        tar the job's results folder (and PATHs) into $OUT/NAME.tgz
#
# Why `wait` exits 3: a machine goes back about 30 s after a call returns, and the next call gets a fresh one with
# nothing of the job on it. A waiting loop that only looked for the job's end marker would then wait out its whole
# call for a job that no longer exists (on 2026-11-27 that cost 400 s of held time and the job's results). `wait`
# says so at once, so the next call can start the job again.
#
# The script runs with its working directory the copy (so later calls, which replace the tree, cannot change it under
# a running job) and with RESULTS set to $DEVICE_JOBS/NAME/results: what it writes there as it goes is what `collect`
# returns, finished or not. $DEVICE_JOBS defaults to /tmp/physreason-jobs.
set -uo pipefail
jobs_root=${DEVICE_JOBS:-/tmp/physreason-jobs}

usage() { sed -n '3,9p' "$0" >&2; exit 2; }

[ $# -ge 2 ] || usage
cmd=$1 name=$2
shift 2
case $name in
    ''|*/*|.*) echo "device_job: job name '$name' must be a plain name (no '/', not starting with '.')" >&2; exit 2 ;;
esac
job=$jobs_root/$name

case $cmd in
start)
    [ $# -ge 1 ] || usage
    script=$1
    shift
    [ -f "$script" ] || { echo "device_job: no script $script (a path from the project root)" >&2; exit 2; }
    if [ -f "$job/started" ] && [ ! -f "$job/rc" ]; then
        echo "device_job: job $name is already running since $(cat "$job/started"); wait for it or pick another name" >&2
        exit 2
    fi
    rm -rf "$job"
    mkdir -p "$job/results"
    # The tree without the folders a call carries (wheel parts are installed already; the copy is for the script).
    tar --exclude=./.device-wheels --exclude=./.device-vllm --exclude=./.device-ray --exclude=./.device-trl \
        --exclude=./.git -cf - . | (mkdir -p "$job/repo" && tar -xf - -C "$job/repo") \
        || { echo "device_job: could not copy the tree to $job/repo" >&2; exit 1; }
    date -u '+%F %T UTC' > "$job/started"
    (
        cd "$job/repo" || exit 1
        RESULTS=$job/results setsid nohup bash -c '
            bash "$0" "$@"; rc=$?
            echo "$rc" > "$RESULTS/../rc.tmp" && mv "$RESULTS/../rc.tmp" "$RESULTS/../rc"
        ' "$script" "$@" > "$job/log" 2>&1 < /dev/null &
    )
    echo "device_job: started $name ($script) at $(cat "$job/started"); log $job/log, results $job/results"
    ;;
wait)
    [ $# -ge 1 ] || usage
    seconds=$1 lines=${2:-20}
    case $seconds in ''|*[!0-9]*) echo "device_job: SECONDS must be a whole number, not '$seconds'" >&2; exit 2 ;; esac
    if [ ! -f "$job/started" ]; then
        echo "device_job: job $name was never started on this machine: the machine is a fresh one (the last one went" \
             "back between calls), so its results are gone; start it again" >&2
        exit 3
    fi
    end=$((SECONDS + seconds))
    while [ ! -f "$job/rc" ] && [ $SECONDS -lt $end ]; do sleep 2; done
    echo "--- $name: log, last $lines lines"
    tail -n "$lines" "$job/log"
    if [ -f "$job/rc" ]; then
        rc=$(cat "$job/rc")
        echo "device_job: $name ended with exit status $rc (started $(cat "$job/started"), ended $(date -u -r "$job/rc" '+%F %T UTC'))"
        exit "$rc"
    fi
    echo "device_job: $name still running after $seconds s (started $(cat "$job/started")); wait again in the next call," \
         "within 30 s of this one's return"
    exit 75
    ;;
collect)
    [ -d "$job/results" ] || { echo "device_job: job $name has no results on this machine" >&2; exit 3; }
    : "${OUT:?device_job: OUT is not set (collect writes \$OUT/$name.tgz)}"
    cp "$job/log" "$job/results/job.log" 2>/dev/null
    tar -czf "$OUT/$name.tgz" -C "$job" results "$@" && echo "device_job: $OUT/$name.tgz ($(du -h "$OUT/$name.tgz" | cut -f1))"
    ;;
*) usage ;;
esac
