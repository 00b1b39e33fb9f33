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
#   tests/run.sh PYTHON [pytest args for the rest]
set -u
py=$1
shift
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
lanes=("tests/lab" "tests/test_fleet_e2e.py tests/test_asha_fleet.py")
pids=()
for i in "${!lanes[@]}"; do
  # pytest's 5 is "no tests collected": a lane with nothing to run is not a failure
  ( "$py" -m pytest -q ${lanes[$i]} --basetemp="$tmp/lane$i"; rc=$?; [ $rc -eq 5 ] && rc=0; exit $rc ) \
    > "$tmp/lane$i.log" 2>&1 &
  pids+=($!)
done
nice -n 10 "$py" -m pytest -q -n 2 --dist loadfile $(printf -- "--ignore=%s " ${lanes[*]}) "$@"
status=$?
for i in "${!lanes[@]}"; do
  wait "${pids[$i]}"
  rc=$?
  echo "====== ${lanes[$i]} (ran alongside the above) ======"
  cat "$tmp/lane$i.log"
  [ "$status" -eq 0 ] && status=$rc
done
exit "$status"
