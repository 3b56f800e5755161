#!/usr/bin/env bash
# The evaluation suite (issues 7 and 15): throughput and maximum micro-batch on flash
# attention, then on unfused attention, accuracy (plain, then the outlier stress setting),
# then the results page. Full mode by default (aim: under 45 minutes on an otherwise idle
# 2-core machine); pass --quick for a smoke run. Run it when the machine is otherwise idle:
# the throughput numbers are wall-clock medians (the memory-ample comparison is CPU time).
#
#     scripts/run_all_benchmarks.sh [--quick]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
MODE=()
if [[ "${1:-}" == "--quick" ]]; then MODE=(--quick); fi
started=$(date +%s)
took=()
part() {  # part NAME COMMAND...: run one part and note how long it took
    local name=$1 began
    shift
    began=$(date +%s)
    "$@"
    took+=("$name: $(( $(date +%s) - began )) s")
    echo "== $name took $(( $(date +%s) - began )) s"
}
for attention in flash unfused; do
    part "throughput, $attention" "$PYTHON" scripts/bench_throughput.py "${MODE[@]}" \
        --attention-backend "$attention"
    part "max micro-batch, $attention" "$PYTHON" scripts/bench_max_batch.py "${MODE[@]}" \
        --attention-backend "$attention"
done
part "accuracy" "$PYTHON" scripts/bench_accuracy.py "${MODE[@]}"
part "accuracy, outlier stress" "$PYTHON" scripts/bench_accuracy.py "${MODE[@]}" --stress
"$PYTHON" scripts/make_results_page.py
printf '%s\n' "${took[@]}"
echo "suite took $(( $(date +%s) - started )) s"
