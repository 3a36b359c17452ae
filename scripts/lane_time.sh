# Sourced by scripts/test: run one lane of the suite and print its wall time at its end, e.g.
#   scripts/test: lane 1/3 fast: 1:52 (exit 0)
# (tests/test_readme.py runs these functions on their own.)

# H:MM:SS or M:SS of a whole number of seconds.
lane_duration() {
  local s=$1
  if [ "$s" -ge 3600 ]; then
    printf '%d:%02d:%02d' $((s / 3600)) $((s % 3600 / 60)) $((s % 60))
  else
    printf '%d:%02d' $((s / 60)) $((s % 60))
  fi
}

# run_lane LABEL COMMAND...: run COMMAND, then print LABEL's wall time and exit code; returns
# the command's exit code.
run_lane() {
  local label=$1 start=$SECONDS rc=0
  shift
  "$@" || rc=$?
  echo "scripts/test: lane $label: $(lane_duration $((SECONDS - start))) (exit $rc)"
  return "$rc"
}
