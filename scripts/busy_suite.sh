#!/usr/bin/env bash
# The suite on a busy machine (issue 43): the README's test command N times in a row on a fresh clone of this
# repository's HEAD, while configs/quickstart.yaml runs beside it, again and again, on the same cores. Stops at
# the first failing run. Each run's exit code, wall time and load average go to OUT/summary.tsv, its output to
# OUT/suite-I.log; the quickstart runs' to OUT/quickstart.log.
#
# Usage: scripts/busy_suite.sh [N=5] [OUT=/tmp/busy_suite]     (33-45 minutes a run on 2 cores: docs/reliability.md)
set -euo pipefail
runs=${1:-5}
out=$(realpath -m "${2:-/tmp/busy_suite}")
repo=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
rm -rf "$out/clone"
git clone -q "$repo" "$out/clone"
cd "$out/clone"
bash scripts/setup.sh
commit=$(git rev-parse --short HEAD)

(  # the neighbour: quickstart after quickstart until the suite runs are over
  i=0
  while true; do
    i=$((i + 1))
    rm -rf "$out/quickstart-run"
    .venv/bin/opd-sao run configs/quickstart.yaml --run-dir "$out/quickstart-run" >>"$out/quickstart.log" 2>&1 \
      && echo "quickstart $i: passed" >>"$out/quickstart.log" || echo "quickstart $i: exit $?" >>"$out/quickstart.log"
  done
) &
neighbour=$!
trap 'kill $neighbour 2>/dev/null; pkill -f "$out/quickstart-run" || true' EXIT

printf 'commit\trun\texit\twall_s\tload_1min_at_end\n' >>"$out/summary.tsv"
for i in $(seq 1 "$runs"); do
  start=$(date +%s)
  set +e
  .venv/bin/pytest -q -n 2 --dist loadfile >"$out/suite-$i.log" 2>&1
  code=$?
  set -e
  printf '%s\t%s\t%s\t%s\t%s\n' "$commit" "$i" "$code" "$(($(date +%s) - start))" \
    "$(cut -d' ' -f1 /proc/loadavg)" >>"$out/summary.tsv"
  tail -1 "$out/suite-$i.log"
  [ "$code" -eq 0 ] || { echo "run $i failed: $out/suite-$i.log" >&2; exit 1; }
done
echo "$runs runs in a row passed beside quickstart ($(grep -c passed "$out/quickstart.log" || true) quickstart runs finished)"
