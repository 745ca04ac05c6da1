#!/usr/bin/env bash
# Flake hunt: the README's test command on a fresh clone of HEAD with a fresh venv, then the suite again in that venv,
# one run per RUN, each as a differently fast machine would run it; prints every test that failed in any run (a test
# that can fail by timing is a defect to fix: it should wait for the state it asserts on, never for an interval).
#   bash scripts/fresh-runs.sh [RUN...]         default: plain plain plain
#     plain          the suite as it is
#     hog[=K]        K busy processes beside it (default: one per core): every process gets a fraction of a core,
#                    as on a slower or shared machine
#     threads=T      every engine the suite starts (and torch in pytest itself) runs T threads (OMP_NUM_THREADS);
#                    more than the cores: engines slow and jittery; 1: engines fast against one core each
#     N (a number)   N plain runs
#   e.g. bash scripts/fresh-runs.sh plain plain hog      # the done-when of issue 55: three in a row, one under a hog
set -uo pipefail
runs=("$@")
[ ${#runs[@]} -eq 0 ] && runs=(plain plain plain)
if [ ${#runs[@]} -eq 1 ] && [[ ${runs[0]} =~ ^[0-9]+$ ]]; then
  n=${runs[0]}; runs=(); for _ in $(seq 1 "$n"); do runs+=(plain); done
fi
for run in "${runs[@]}"; do
  [[ $run =~ ^(plain|hog(=[0-9]+)?|threads=[0-9]+)$ ]] || { echo "unknown run '$run': plain, hog[=K] or threads=T" >&2; exit 2; }
done
repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
clone=$(mktemp -d /tmp/kvfleet-fresh-XXXXXX)
git clone -q "$repo" "$clone" && cd "$clone" || exit 1
cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)
features=$(grep -m1 '^flags' /proc/cpuinfo | grep -o -w 'amx_tile\|avx512_bf16\|avx2' | sort -u | xargs)
echo "fresh clone of $(git rev-parse --short HEAD) in $clone; CPU: $cpu, $(nproc) cores ($features)"

hogs=()
start_hog() {  # $1 busy processes, each a loop with nothing to wait for
  for _ in $(seq 1 "$1"); do python3 -c 'while True: pass' & hogs+=($!); done
}
stop_hog() {
  [ ${#hogs[@]} -gt 0 ] && kill "${hogs[@]}" 2>/dev/null
  hogs=()
}
trap stop_hog EXIT

i=0
for run in "${runs[@]}"; do
  i=$((i + 1))
  env=()
  case $run in
    hog) start_hog "$(nproc)" ;;
    hog=*) start_hog "${run#hog=}" ;;
    threads=*) env=(OMP_NUM_THREADS="${run#threads=}") ;;
  esac
  start=$(date +%s)
  # shellcheck disable=SC1091
  if [ "$i" = 1 ]; then env "${env[@]}" bash scripts/test.sh -p no:cacheprovider > "run$i.log" 2>&1
  else (. .venv-test/bin/activate && env "${env[@]}" python -m pytest -q -p no:cacheprovider) > "run$i.log" 2>&1; fi
  rc=$?
  stop_hog
  echo "run $i ($run): exit $rc in $(( $(date +%s) - start )) s: $(grep -E '[0-9]+ (passed|failed)' "run$i.log" | tail -n 1)"
done
echo "failed in any run:"
cat run*.log | grep -E '^(FAILED|ERROR) ' | sed 's/ - .*//' | sort | uniq -c | sort -rn
