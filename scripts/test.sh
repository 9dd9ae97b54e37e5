#!/usr/bin/env bash
# The test suite as two pytest processes at once (make test): the tests on the Ray cluster in
# one, the others (engine, transport, planner, bench, API units) in the other, so both cores
# work while the served tests wait on replicas. Extra arguments go to both.
set -u
PY=${PY:-.venv/bin/python}
log=$(mktemp)
TANDEM_TEST_PART=local TANDEM_TEST_THREADS=1 "$PY" -m pytest -p no:cacheprovider --durations=10 "$@" >"$log" 2>&1 &
local_pid=$!
TANDEM_TEST_PART=ray "$PY" -m pytest --durations=20 "$@"
ray_rc=$?
wait "$local_pid"
local_rc=$?
echo "================ the tests off Ray (run alongside the above) ================"
cat "$log"
rm -f "$log"
echo "tests on Ray: exit $ray_rc; the others: exit $local_rc"
[ "$ray_rc" -eq 0 ] && [ "$local_rc" -eq 0 ]
