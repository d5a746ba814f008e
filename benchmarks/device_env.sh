# Sourced by the benchmarks/*_device.sh scripts, from the repository root: installs what the GPU
# machine's python3 lacks from the wheels in ./.whl, when that folder holds any (which ones and how to
# fetch them: benchmarks/dipaco_device.sh), puts them and the checkout on PYTHONPATH, and prints the GPU.
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/dipaco_site .whl/*.whl
    export PYTHONPATH=/tmp/dipaco_site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
