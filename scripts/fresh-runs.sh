#!/usr/bin/env bash
# Flake hunt: the README's test command on a fresh clone of HEAD with a fresh venv, then the suite again N-1 times in
# that venv; prints every test that failed in any run (a test that can fail by timing is a defect to fix).
#   bash scripts/fresh-runs.sh [N]              # default 3
set -uo pipefail
runs=${1:-3}
repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
clone=$(mktemp -d /tmp/kvfleet-fresh-XXXXXX)
git clone -q "$repo" "$clone" && cd "$clone" || exit 1
echo "fresh clone of $(git rev-parse --short HEAD) in $clone; CPU: $(grep -q amx_tile /proc/cpuinfo && echo AMX || echo 'no AMX')"
for i in $(seq 1 "$runs"); do
  start=$(date +%s)
  # shellcheck disable=SC1091
  if [ "$i" = 1 ]; then bash scripts/test.sh -p no:cacheprovider > "run$i.log" 2>&1
  else (. .venv-test/bin/activate && python -m pytest -q -p no:cacheprovider) > "run$i.log" 2>&1; fi
  rc=$?
  echo "run $i: exit $rc in $(( $(date +%s) - start )) s: $(grep -E '[0-9]+ (passed|failed)' "run$i.log" | tail -n 1)"
done
echo "failed in any run:"
cat run*.log | grep -E '^(FAILED|ERROR) ' | sed 's/ - .*//' | sort | uniq -c | sort -rn
