#!/usr/bin/env bash
# The whole suite as two runs side by side: the lab (tests/lab: hosts in network
# namespaces, mostly waiting out real faults: a 30-s link cut, a host powered off,
# head restarts) and everything else, which is CPU-bound and runs at a lower CPU
# priority so that the lab's own timeouts hold. On two cores this takes the
# lab's ~10 minutes off the wall time. The lab's output is printed after the
# rest's; the exit status is the first failure's.
#   tests/run.sh PYTHON [pytest args for the rest]
set -u
py=$1
shift
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$py" -m pytest -q tests/lab --basetemp="$tmp/lab" > "$tmp/lab.log" 2>&1 &
lab=$!
nice -n 10 "$py" -m pytest -q --ignore=tests/lab "$@"
rest=$?
wait "$lab"
labrc=$?
echo "=================== tests/lab (ran alongside the above) ==================="
cat "$tmp/lab.log"
# pytest's 5 is "no tests collected": a lab lane with nothing to run is not a failure
[ "$labrc" -eq 5 ] && labrc=0
[ "$rest" -ne 0 ] && exit "$rest"
exit "$labrc"
