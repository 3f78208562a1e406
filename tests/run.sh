#!/bin/sh
# Runs each test program given, shows its output, and prints one summary
# line across all of them. Exits non-zero if any program failed.
passed=0 failed=0 skipped=0 programs=0 broken=""
for t in "$@"; do
    programs=$((programs + 1))
    out=$("$t" 2>&1); rc=$?
    printf '%s\n' "$out"
    p=$(printf '%s\n' "$out" | sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' | awk '{s+=$1} END {print s+0}')
    f=$(printf '%s\n' "$out" | sed -n 's/^\[  FAILED  \] \([0-9]*\) test.*/\1/p' | awk '{s+=$1} END {print s+0}')
    s=$(printf '%s\n' "$out" | sed -n 's/^\[  SKIPPED \] \([0-9]*\) test.*/\1/p' | awk '{s+=$1} END {print s+0}')
    passed=$((passed + p)); failed=$((failed + f)); skipped=$((skipped + s))
    if [ $rc -ne 0 ]; then broken="$broken $(basename "$t")"; fi
done
echo "=================================================================="
echo "kvd tests: $passed passed, $failed failed, $skipped skipped in $programs programs"
if [ -n "$broken" ]; then
    echo "failing programs:$broken"
    exit 1
fi
