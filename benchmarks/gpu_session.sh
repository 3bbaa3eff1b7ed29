#!/usr/bin/env bash
# One device call's worth of GPU checks (about 8 minutes on an H100): the CUDA tests, then the decode and
# training figures of benchmarks/gpu.py; a log per part goes to $OUT (the device tool's folder) or ./gpu-out
# (at most 6 files, within what the device tool brings back).
#
#   bash benchmarks/gpu_session.sh                 # this tree
#   OLD=.gpu/old bash benchmarks/gpu_session.sh    # and an older tree's relayrl/ + benchmarks/ in the same run
#
# OLD: a folder holding an earlier commit's relayrl/ and benchmarks/ (`git archive REV relayrl benchmarks |
# tar -x -C .gpu/old`), timed right after this tree's figures on the same warm GPU, for a before/after ratio.
# TESTS: pytest's -k expression for the CUDA tests ("" runs them all); TEST_S / PART_S: time limits.
# PARTS: which of "tests decode profile train" to run (all by default). TRACE=1: a profiler trace of the
# decode (folder $OUT/trace; large).
set -u -o pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PARTS=${PARTS:-tests decode profile train}
TEST_S=${TEST_S:-240}
PART_S=${PART_S:-150}
DECODE=(--only decode --decode-sizes 256 --compile-decode --decode-flex --decode-bucket 64 --decode-breakdown)
TRAIN=(--only train --train-variants flex+compile+fusedhead+copy,flex+compile+fusedhead+copy+graphs)
has() { [[ " $PARTS " == *" $1 "* ]]; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

if has tests; then
  echo "== CUDA tests"
  timeout "$TEST_S" python3 -m pytest -q -p no:cacheprovider tests/engines/test_cuda.py \
    tests/engines/test_flex_attention.py tests/checkpoint/test_rng_state.py tests/config/test_placement.py \
    ${TESTS:+-k "$TESTS"} 2>&1 | tee "$OUT/tests.log" | tail -25
fi

run() {  # run NAME TREE ARGS...: one part of gpu.py from TREE (. or $OLD), its last lines shown, all logged
  local name=$1 tree=$2; shift 2
  echo "== $name ($tree)"
  timeout "$PART_S" python3 "$tree/benchmarks/gpu.py" "$@" 2>&1 \
    | tee "$OUT/$name.log" | grep -v "^\s*$" | tail -30
}

has decode && run decode . "${DECODE[@]}" ${TRACE:+--trace "$OUT/trace"}
has decode && [[ -n "${OLD:-}" ]] && run decode-old "$OLD" --only decode --decode-sizes 256 --compile-decode \
  --no-decode-baselines
has profile && run profile . --only profile --compile-decode --decode-flex
has train && run train . "${TRAIN[@]}"
has train && [[ -n "${OLD:-}" ]] && run train-old "$OLD" "${TRAIN[@]}"
echo "== done"
