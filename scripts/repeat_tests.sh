#!/usr/bin/env bash
# Run test files again and again, to find intermittent failures: scripts/repeat_tests.sh N LOG_DIR TEST_FILE...
# Each round is one pytest run of the files (-p no:cacheprovider, its own --basetemp so every rank's log stays
# in LOG_DIR/round-K/); LOG_DIR/summary.txt gets one line per round (passed / failed, seconds) and the count of
# ranks that aborted ("terminate called", SIGABRT) in that round, failed or not.
set -uo pipefail
rounds=$1 logs=$2
shift 2
mkdir -p "$logs"
python=${PYTHON:-.venv/bin/python}
failures=0
for ((k = 1; k <= rounds; k++)); do
  start=$(date +%s)
  "$python" -m pytest -q -x -p no:cacheprovider --basetemp "$logs/round-$k" "$@" > "$logs/round-$k.log" 2>&1
  status=$?
  aborts=$(grep -rls "terminate called\|Fatal Python error: Aborted" "$logs/round-$k" "$logs/round-$k.log" 2> /dev/null | wc -l)
  [ "$status" -eq 0 ] || failures=$((failures + 1))
  echo "round $k: $([ "$status" -eq 0 ] && echo passed || echo "FAILED ($status)") in $(($(date +%s) - start)) s," \
    "$aborts file(s) with an abort; $(tail -n 1 "$logs/round-$k.log")" >> "$logs/summary.txt"
done
echo "$failures of $rounds rounds failed" >> "$logs/summary.txt"
