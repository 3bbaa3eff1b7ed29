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
# TEST_FILES: the test files (the four that hold CUDA tests by default). TESTS: pytest's -k expression for the CUDA tests ("" runs them all); TEST_S / PART_S: time limits.
# PARTS: which of "tests decode profile train" to run, in that order (all by default). TRACE=1: a profiler
# trace of the decode (folder $OUT/trace; large). DECODE_ARGS / TRAIN_ARGS: extra arguments of those parts
# (for example TRAIN_ARGS=--profile, DECODE_ARGS=--no-decode-baselines); DECODE_S / TRAIN_S: their limits.
set -u -o pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PARTS=${PARTS:-tests decode profile train}
TEST_S=${TEST_S:-240}
TEST_FILES=${TEST_FILES:-tests/engines/test_cuda.py tests/engines/test_flex_attention.py tests/checkpoint/test_rng_state.py \
  tests/config/test_placement.py}
PART_S=${PART_S:-150}
DECODE=(--only decode --decode-sizes 256 --compile-decode --decode-flex --decode-bucket 64 --decode-breakdown)
TRAIN=(--only train --train-variants flex+compile+fusedhead+copy,flex+compile+fusedhead+copy+graphs)

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

tests() {
  echo "== CUDA tests"
  timeout "$TEST_S" python3 -m pytest -q -p no:cacheprovider $TEST_FILES ${TESTS:+-k "$TESTS"} 2>&1 | tee "$OUT/tests.log" | tail -25
}

run() {  # run NAME TREE LIMIT ARGS...: one part of gpu.py from TREE (. or $OLD), its last lines shown, all logged
  local name=$1 tree=$2 limit=$3; shift 3
  echo "== $name ($tree)"
  timeout "$limit" python3 "$tree/benchmarks/gpu.py" "$@" 2>&1 \
    | tee "$OUT/$name.log" | grep -v "^\s*$" | tail -40
}

for part in $PARTS; do
  case $part in
    tests) tests ;;
    decode)
      run decode . "${DECODE_S:-$PART_S}" "${DECODE[@]}" ${TRACE:+--trace "$OUT/trace"} ${DECODE_ARGS:-}
      [[ -n "${OLD:-}" ]] && run decode-old "$OLD" "${DECODE_S:-$PART_S}" --only decode --decode-sizes 256 \
        --compile-decode --no-decode-baselines ;;
    profile) run profile . "$PART_S" --only profile --compile-decode --decode-flex ;;
    train)
      run train . "${TRAIN_S:-$PART_S}" "${TRAIN[@]}" ${TRAIN_ARGS:-}
      [[ -n "${OLD:-}" ]] && run train-old "$OLD" "${TRAIN_S:-$PART_S}" "${TRAIN[@]}" ;;
    *) echo "gpu_session: unknown part $part (tests, decode, profile, train)"; exit 2 ;;
  esac
done
echo "== done"
