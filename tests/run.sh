#!/usr/bin/env bash
# The whole suite as three runs side by side: two side lanes of what mostly waits
# (the lab, tests/lab: hosts in network namespaces waiting out real faults, a
# 30-s link cut, a host powered off, head restarts; and the fleet on this
# machine, tests/test_fleet_e2e.py and tests/test_asha_fleet.py, whose trials
# wait on Ray) and everything else, which is CPU-bound and runs in two pytest
# workers (pytest-xdist; a module to a worker, so that a module still shares its
# one Ray cluster) at a lower CPU priority, so that the side lanes' own timeouts
# hold. On two cores that keeps both cores busy to the end: the lanes take ~15,
# ~7 and ~16 minutes side by side, where the fleet's tests in the lab's lane made
# that lane ~19 minutes, its last ~3 on a core mostly idle. Each side lane's
# output is printed after the rest's; the exit status is the first failure's.
#
# Ctrl-C (or SIGTERM) stops all three through their teardown (the lab's hosts
# taken down, every Ray cluster stopped), each given one SIGINT. They start under
# job control (`set -m`): each in a process group of its own, so a terminal's
# Ctrl-C reaches them only through this script, never twice (a second one would
# cut a teardown short), and with SIGINT at its default, where a background
# command otherwise starts with it ignored (and Python then never raises
# KeyboardInterrupt). A Ctrl-C while they start is held until all three run.
#   tests/run.sh PYTHON [pytest args for the rest]
set -u
py=$1
shift
# One OpenBLAS thread a process: the three runs are four processes on two cores
# (more with Ray's), and OpenBLAS's own thread per core on top of them spent a
# third of their system time switching (tests/test_batches.py, test_fused.py,
# test_ragged.py and test_long.py in four workers: 75.7 s wall, 34.6 s system
# time; one thread each, 66.2 s and 14.9 s). A run of its own (make demo) keeps both.
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
lanes=("tests/lab" "tests/test_fleet_e2e.py tests/test_asha_fleet.py")
pids=()
rest=
launched= stopping= sent=
stop() {
  stopping=1
  if [ -n "$launched" ] && [ -z "$sent" ]; then
    sent=1
    kill -INT "$rest" "${pids[@]}" 2> /dev/null
  fi
}
trap stop INT TERM
set -m
for i in "${!lanes[@]}"; do
  "$py" -m pytest -q ${lanes[$i]} --basetemp="$tmp/lane$i" \
    > "$tmp/lane$i.log" 2>&1 &
  pids+=($!)
done
nice -n 10 "$py" -m pytest -q -n 2 --dist loadfile \
  $(printf -- "--ignore=%s " ${lanes[*]}) "$@" &
rest=$!
set +m
launched=1
[ -n "$stopping" ] && stop

# A trap cuts a `wait` short: wait again until the process is gone.
finish() {
  local rc
  while :; do
    wait "$1"
    rc=$?
    kill -0 "$1" 2> /dev/null || return "$rc"
  done
}
finish "$rest"
status=$?
for i in "${!lanes[@]}"; do
  finish "${pids[$i]}"
  rc=$?
  # pytest's 5 is "no tests collected": a lane with nothing to run is not a failure
  [ "$rc" -eq 5 ] && rc=0
  echo "====== ${lanes[$i]} (ran alongside the above) ======"
  cat "$tmp/lane$i.log"
  [ "$status" -eq 0 ] && status=$rc
done
exit "$status"
