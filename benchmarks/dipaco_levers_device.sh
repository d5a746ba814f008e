#!/usr/bin/env bash
# DiPaCo's levers side by side on one CUDA GPU: `bash benchmarks/dipaco_levers_device.sh [OUT_DIR]`,
# from the repository root (what the machine's python3 needs: see benchmarks/dipaco_device.sh, whose
# ./.whl wheels this installs the same way).
#
# One corpus for every arm, large enough that no arm repeats data: the Python standard library's and
# the installed packages' sources (`benchmarks.stdlib_corpus --site_packages`, each paragraph once).
# Every arm is its own `benchmarks.dipaco` process at budget $BUDGET (default 2.5: batches of 128 x 64
# tokens), all started together: the models are small, so one process leaves the GPU mostly idle and
# several share it at little cost to each. Each arm writes OUT_DIR/ARM/{log.txt,dipaco.json,...}.
#
#   width_64_seed_S   the 2x2 grid at d=64 (the curve's model) with its three dense baselines
#   width_32_seed_S   the same at d=32: ~3.3x fewer parameters per path, so ~3.3x the tokens per parameter
#   width_16_seed_S   d=16: ~10x
#   relabel_32        d=32, discriminative re-routing half-way (DiPaCo's), against the same baselines
#   budget_B_seed_S   d=64 at budget 1, 4 or 8 (4, 8: without the all-params model), for the budget curve on
#                     data that no arm repeats
#   grid2x4_32        d=32, a 2x4 grid (two levels of four modules: 16 paths of the same size) at the
#                     2x2's tokens, each path a quarter of the steps
#
# An arm's own --budgets (the budget_* arms) overrides $BUDGET.
# Every arm also scores its grid with every evaluation window re-routed (`composite_rerouted_ppl`).
# Environment: BUDGET, BATCH, DEVICE (default cuda), ARMS (a space-separated subset of the names above), TIMEOUT_SECONDS
# (each arm's limit, default 480).
set -euo pipefail
out=${1:-out/dipaco_levers}
mkdir -p "$out"
source benchmarks/device_env.sh
export TQDM_DISABLE=1
corpus=/tmp/dipaco_levers_corpus.jsonl
python3 -m benchmarks.stdlib_corpus --site_packages --out "$corpus" | tee "$out/corpus.txt"

declare -A flags=(
    [width_64_seed_1]="--d_model 64 --seeds 1"
    [width_64_seed_2]="--d_model 64 --seeds 2"
    [width_32_seed_1]="--d_model 32 --seeds 1"
    [width_32_seed_2]="--d_model 32 --seeds 2"
    [width_16_seed_1]="--d_model 16 --seeds 1"
    [width_16_seed_2]="--d_model 16 --seeds 2"
    [relabel_32]="--d_model 32 --seeds 1 --relabel_at 0.5 --no_dense_all_params"
    [grid2x4_32]="--d_model 32 --seeds 1 --grids 2x4 --steps_per_path 150 --no_dense_all_params"
    [budget_1_seed_1]="--d_model 64 --seeds 1 --budgets 1"
    [budget_1_seed_2]="--d_model 64 --seeds 2 --budgets 1"
    [budget_4_seed_1]="--d_model 64 --seeds 1 --budgets 4 --no_dense_all_params"
    [budget_4_seed_2]="--d_model 64 --seeds 2 --budgets 4 --no_dense_all_params"
    [budget_8_seed_1]="--d_model 64 --seeds 1 --budgets 8 --no_dense_all_params"
    [budget_8_seed_2]="--d_model 64 --seeds 2 --budgets 8 --no_dense_all_params"
)
arms=${ARMS:-"width_64_seed_1 width_64_seed_2 width_32_seed_1 width_32_seed_2 width_16_seed_1 width_16_seed_2 relabel_32 grid2x4_32"}
pids=()
for arm in $arms; do
    [ -n "${flags[$arm]:-}" ] || { echo "unknown arm $arm (known: ${!flags[*]})" >&2; exit 2; }
    mkdir -p "$out/$arm"
    # shellcheck disable=SC2086  # the flags are words
    timeout "${TIMEOUT_SECONDS:-480}" python3 -m benchmarks.dipaco --out "$out/$arm" --device "${DEVICE:-cuda}" \
        --threads 2 --batch_size "${BATCH:-128}" --budgets "${BUDGET:-2.5}" --data_files "$corpus" \
        ${flags[$arm]} >"$out/$arm/log.txt" 2>&1 &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
for arm in $arms; do echo "== $arm"; grep -E "^\[x|^\| ×" "$out/$arm/log.txt" | tail -12 || true; done
# One archive of every arm's outputs (a device run brings back a few files only)
tar -czf "$out.tar.gz" -C "$(dirname "$out")" "$(basename "$out")"
exit $status
