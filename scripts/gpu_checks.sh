#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run: the `gpu`-marked tests and chapter 10's runs on the GPU, each with
# its --json, plus the provenance of the machine (GPU, driver, Python, torch, CUDA, commit). The book keeps what
# comes back under chapter 10's results/<gpu>/ folder and its lesson quotes it as a recorded run (CI has no GPU).
#
#   OUT=/tmp/gpu bash scripts/gpu_checks.sh          # from the repository root, on a machine with a CUDA GPU
#
# Writes at most 8 files into $OUT: provenance.txt, gpu_tests.txt, runs.txt, one JSON per chapter-10 script and
# cuda_graphs' launch timeline. Tests needing 2+ GPUs skip themselves on one.
set -u
OUT=${OUT:-/tmp/gpu_checks}
PY=${PY:-python3}
mkdir -p "$OUT"
FIG=$(mktemp -d)
export PYTHONUNBUFFERED=1 MLSYS_CACHE=${MLSYS_CACHE:-$PWD/.cache}
{
    date -u +"date %Y-%m-%dT%H:%M:%SZ"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    $PY -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda',
torch.version.cuda, '|', torch.cuda.get_device_name(), '|', torch.cuda.device_count(), 'GPU(s)')"
    echo "commit ${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
    nproc | sed 's/^/cpu cores /'
} > "$OUT/provenance.txt" 2>&1
timeout 300 "$PY" -m pytest -q -p no:cacheprovider -m gpu -o addopts="" -rs --timeout 240 \
    tests/test_ch10_scheduling.py tests/test_ch14_weight_sync.py tests/test_engine.py tests/test_launcher.py \
    > "$OUT/gpu_tests.txt" 2>&1
echo "pytest exit $?" >> "$OUT/gpu_tests.txt"
D=tutorial/part3-inference/chapter10-scheduling-cuda-graphs/scripts
for s in cuda_graphs overlap_scheduling step_breakdown chunked_prefill; do
    echo "=== python $D/$s.py --device cuda" >> "$OUT/runs.txt"
    timeout 150 "$PY" "$D/$s.py" --device cuda --json "$OUT/$s.json" --plot-dir "$FIG/$s" >> "$OUT/runs.txt" 2>&1
    echo "exit $?" >> "$OUT/runs.txt"
done
cp "$FIG/cuda_graphs/launches.png" "$OUT/cuda_graphs_launches.png" 2>/dev/null
exit 0
