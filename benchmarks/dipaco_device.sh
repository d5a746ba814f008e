#!/usr/bin/env bash
# The DiPaCo budget sweep on one CUDA GPU: `bash benchmarks/dipaco_device.sh [OUT_DIR] [more flags]`,
# from the repository root, with a python3 that has torch (CUDA), numpy, tqdm, matplotlib, pyarrow,
# pandas, pyyaml, xxhash, fsspec, filelock and huggingface_hub. What such a machine may lack
# (pydantic, pydantic-core, annotated-types, typing-inspection, typing-extensions, datasets, dill,
# multiprocess) is installed from wheels in ./.whl when that folder holds any; fetch them where pip
# reaches a registry with (3.6 MB; the versions this project's environment holds):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl pydantic==2.14.4 \
#     pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 \
#     datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
#
# The sweep reaches about 20x the tokens per parameter of the CPU default's budget 1 (21 tokens per
# parameter of the dense-same-tokens model): batches of 128 x 64 tokens carry 8x the default's 16 x 64,
# and budgets 0.25, 1 and 2.5 give 2x, 8x and 20x. Every arm sees each token once at most on the
# built-in corpus of 80,000 documents (the epochs line printed before training says so); DATA=stdlib
# trains on the Python standard library's sources instead (real text; about 19 M tokens, so the
# largest budget repeats it ~2.8 times, which dipaco.json's epochs report).
# Environment: BUDGETS, SEEDS, BATCH, DATA=builtin|stdlib, BUILTIN_DOCS override the choices above.
set -euo pipefail
out=${1:-out/dipaco_gpu}
shift || true
source benchmarks/device_env.sh
# tqdm bars redraw every 30 s at most: the per-arm log lines carry the elapsed time, and a log file
# keeps its last lines readable
export TQDM_MININTERVAL=30
data=(--builtin_docs "${BUILTIN_DOCS:-80000}")
if [ "${DATA:-builtin}" = stdlib ]; then
    python3 -m benchmarks.stdlib_corpus --recursive --out /tmp/dipaco_stdlib.jsonl
    data=(--data_files /tmp/dipaco_stdlib.jsonl)
fi
python3 -m benchmarks.dipaco --out "$out" --device cuda --batch_size "${BATCH:-128}" \
    --budgets "${BUDGETS:-0.25,1,2.5}" --seeds "${SEEDS:-1,2}" "${data[@]}" "$@"
