#!/usr/bin/env bash
# Upgrades deliberately: resolves every dependency to its newest release in a new venv, runs the whole suite on them,
# and only if it passes writes those versions to constraints.txt (review the diff, commit it with the run's result).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-update
KVFLEET_TEST_VENV=$venv KVFLEET_CONSTRAINTS=/dev/null bash scripts/test.sh "$@"
{
  echo "# The versions the whole suite last passed with (scripts/update-constraints.sh wrote this on $(date -u +%F),"
  echo "# Python $("$venv/bin/python" -c 'import platform; print(platform.python_version())')). Used by the README's install and test commands and by CI."
  echo "# torch is the user's choice (the CPU wheel here, a CUDA build on GPUs) and is not listed; triton is here for the"
  echo "# test extra's kernel interpreter: a CUDA build of torch brings its own (drop the line there)."
  "$venv/bin/pip" freeze --exclude-editable | grep -v -i -E '^(torch|nvidia-|cuda-)'
} > constraints.txt.new
mv constraints.txt.new constraints.txt
echo "constraints.txt updated: $(git diff --stat -- constraints.txt | tail -n 1)"
