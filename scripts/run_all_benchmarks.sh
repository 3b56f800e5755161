#!/usr/bin/env bash
# The evaluation suite (issue 7): throughput, maximum micro-batch and accuracy, then the
# results page. Full mode by default (aim: under an hour on a quiet 2-core machine); pass
# --quick for a few minutes. Run it when the machine is otherwise idle: the throughput
# numbers are wall-clock medians.
#
#     scripts/run_all_benchmarks.sh [--quick]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
MODE=()
if [[ "${1:-}" == "--quick" ]]; then MODE=(--quick); fi
started=$(date +%s)
"$PYTHON" scripts/bench_throughput.py "${MODE[@]}"
"$PYTHON" scripts/bench_max_batch.py "${MODE[@]}"
"$PYTHON" scripts/bench_accuracy.py "${MODE[@]}"
"$PYTHON" scripts/make_results_page.py
echo "suite took $(( $(date +%s) - started )) s"
