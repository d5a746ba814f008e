#!/usr/bin/env bash
# DiPaCo's outer lr, momentum and H tuned on a validation split, on one CUDA GPU (issue 31 item 4):
# `bash benchmarks/dipaco_tune_device.sh [OUT_DIR]` from the repository root (the machine's python3
# and ./.whl wheels as in benchmarks/dipaco_device.sh).
#
# The corpus of benchmarks/dipaco_levers_device.sh (the standard library's and installed packages'
# sources, each paragraph once; no arm repeats data). $VALIDATION training documents are held out of
# every arm to tune on. Started together, one process each:
#   base_seed_S    benchmarks.dipaco at d=64, budget $BUDGET: the grid at the default outer optimizer
#                  (lr 0.7, Nesterov momentum 0.9, H 50) with its dense baselines (not all-params)
#   tune_S_C       benchmarks.dipaco_tune: the grid alone at candidate C (outer_lr:momentum:H)
# then `benchmarks.dipaco_tune --pick` over all of them: the candidate with the lowest validation
# perplexity over both seeds, its reported perplexity against the same seeds' dense baselines.
# Environment: BUDGET (2.5), BATCH (128), DEVICE (cuda), CANDIDATES, SEEDS ("1 2"), VALIDATION (400), TIMEOUT_SECONDS (420).
set -euo pipefail
out=${1:-out/dipaco_tune}
mkdir -p "$out"
source benchmarks/device_env.sh
export TQDM_DISABLE=1
corpus=/tmp/dipaco_levers_corpus.jsonl
python3 -m benchmarks.stdlib_corpus --site_packages --out "$corpus" | tee "$out/corpus.txt"
common=(--device "${DEVICE:-cuda}" --threads 1 --d_model 64 --batch_size "${BATCH:-128}" --budgets "${BUDGET:-2.5}"
    --data_files "$corpus" --validation_docs "${VALIDATION:-400}")
pids=()
for seed in ${SEEDS:-1 2}; do
    mkdir -p "$out/base_seed_$seed"
    timeout "${TIMEOUT_SECONDS:-420}" python3 -m benchmarks.dipaco --out "$out/base_seed_$seed" "${common[@]}" \
        --seeds "$seed" --no_dense_all_params >"$out/base_seed_$seed/log.txt" 2>&1 &
    pids+=($!)
    for c in ${CANDIDATES:-0.5:0.9:50 1.0:0.9:50 0.7:0.9:25 0.7:0.9:100}; do
        arm="$out/tune_${seed}_${c//:/_}"
        mkdir -p "$arm"
        timeout "${TIMEOUT_SECONDS:-420}" python3 -m benchmarks.dipaco_tune --out "$arm" "${common[@]}" \
            --seeds "$seed" --candidates "$c" >"$arm/log.txt" 2>&1 &
        pids+=($!)
    done
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
for log in "$out"/*/log.txt; do echo "== $log"; grep -E "trained in|^\| ×" "$log" | tail -4 || true; done
python3 -m benchmarks.dipaco_tune --out "$out/pick" --pick "$out" || status=1
tar -czf "$out.tar.gz" -C "$(dirname "$out")" "$(basename "$out")"
exit $status
