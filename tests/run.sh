#!/usr/bin/env bash
# The whole suite as two runs side by side: a side lane of what mostly waits (the
# lab, tests/lab: hosts in network namespaces waiting out real faults, a 30-s link
# cut, a host powered off, head restarts; then the fleet on this machine,
# tests/test_fleet_e2e.py and tests/test_asha_fleet.py, whose trials wait on Ray)
# and everything else, which is CPU-bound and runs at a lower CPU priority so that
# the lab's own timeouts hold. On two cores this takes the side lane's ~14
# minutes off the wall time. The side lane's output is printed after the rest's;
# the exit status is the first failure's.
#   tests/run.sh PYTHON [pytest args for the rest]
set -u
py=$1
shift
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
side="tests/lab tests/test_fleet_e2e.py tests/test_asha_fleet.py"
"$py" -m pytest -q $side --basetemp="$tmp/lab" > "$tmp/lab.log" 2>&1 &
lab=$!
nice -n 10 "$py" -m pytest -q $(printf -- "--ignore=%s " $side) "$@"
rest=$?
wait "$lab"
labrc=$?
echo "====== $side (ran alongside the above) ======"
cat "$tmp/lab.log"
# pytest's 5 is "no tests collected": a lab lane with nothing to run is not a failure
[ "$labrc" -eq 5 ] && labrc=0
[ "$rest" -ne 0 ] && exit "$rest"
exit "$labrc"
