#!/usr/bin/env bash
# One device call's worth of GPU checks (under 10 minutes on an H100): by default the training attention's
# kernel-option sweep, the training variants and the compiled decode of benchmarks/gpu.py; the CUDA tests on
# request. A log per part goes to $OUT (the device tool's folder) or ./gpu-out (at most 6 files).
#
#   bash benchmarks/gpu_session.sh                      # this tree, PARTS="flex train decode"
#   PARTS="tests" bash benchmarks/gpu_session.sh        # the four files that hold the CUDA tests
#   OLD=.gpu/old bash benchmarks/gpu_session.sh         # and an older tree's decode and training, same run
#
# The next session's two calls (planned 2026-11-27; about 8.5 and 4 minutes on one warm machine, with the start
# about 13.5 of the 15 minutes). First, where one update's time goes now (profiled) beside the head's backward a
# vocabulary slice at a time and on stored logits (and those with the head's Triton kernels), and decode with
# the Triton attention and split-K products:
#   V=flex+compile+fusedhead+copy; PARTS="train decode" TRAIN_ARGS=--profile \
#     TRAIN_VARIANTS=$V,$V+vocabgrad,$V+storedgrad,$V+storedgrad+tritonhead TRAIN_S=220 DECODE_S=260 \
#     bash benchmarks/gpu_session.sh
# Then the CUDA tests of what changed since they last ran: test_cuda.py (the new FlexAttention defaults, the
# Triton decode attention, split-K) and the head's two new backward orders:
#   PARTS=tests TEST_S=230 TESTS="not flex or head_grad" \
#     TEST_FILES="tests/engines/test_cuda.py tests/engines/test_flex_attention.py" bash benchmarks/gpu_session.sh
#
# The device image has no pydantic (2026-11-27): download its wheels here into .whl/ (ignored by git through
# .git/info/exclude) and carry .whl; this script installs them into /tmp/site when the folder exists:
#   for p in pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5; do
#     .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux2014_x86_64 -d .whl $p; done
#
# PARTS=moe: MoE routing replay with both engines on the GPU (benchmarks/routing_replay.py, about a minute; MOE_S).
# PARTS: which of "tests flex train decode profile moe" to run, in the order given. TEST_FILES: the test files
# (default: the four that hold CUDA tests); TESTS: pytest's -k expression. OLD: a folder holding an earlier
# commit's relayrl/ and benchmarks/ (`git archive REV relayrl benchmarks | tar -x -C .gpu/old`, carried),
# timed right after this tree's figures for a before/after ratio. DECODE_ARGS / TRAIN_ARGS / FLEX_ARGS: extra
# arguments of those parts (TRAIN_ARGS=--profile, FLEX_ARGS="--flex-presets relayrl,bwd-n1-32"); TRAIN_VARIANTS.
# HF=1: the decode part also times HF generate and the dynamic-cache path. TEST_S, FLEX_S, TRAIN_S, DECODE_S:
# each part's time limit (else PART_S). TRACE=1: a profiler trace of the decode (folder $OUT/trace; large).
# DRY=1: print each part's command instead of running it (no GPU needed; tests/package/test_doc_benchmarks.py
# parses them with the scripts' own parsers).
set -u -o pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PARTS=${PARTS:-flex train decode}
TEST_S=${TEST_S:-240}
TEST_FILES=${TEST_FILES:-tests/engines/test_cuda.py tests/engines/test_flex_attention.py tests/checkpoint/test_rng_state.py \
  tests/config/test_placement.py}
PART_S=${PART_S:-150}
FLEX_S=${FLEX_S:-170} TRAIN_S=${TRAIN_S:-200} DECODE_S=${DECODE_S:-300}  # the limits of each part
# the compiled step, the Triton attention kernel (graphed, then compiled), split-K products (4 and 8 partials,
# with either attention) and, with AUTOTUNE=1, last, the compiled step with max-autotune (about 20 s of
# autotuning per matrix product shape; it outran a 190 s part on 2026-11-27, and a part cut short prints no
# gpu: line);
# DECODE_ARGS=--decode-prefill-compile adds the compiled prefill (22.2% vs 21.8%)
DECODE=(--only decode --decode-sizes 256 --compile-decode --decode-triton --decode-splitk 4,8 --decode-breakdown)
[[ -n "${AUTOTUNE:-}" ]] && DECODE+=(--decode-autotune)  # AUTOTUNE=1: also max-autotune (last; give it 200 s more)
[[ -n "${HF:-}" ]] || DECODE+=(--no-decode-baselines)  # HF=1: also HF generate and the dynamic path (about 55 s)
B=flex+compile+fusedhead+copy  # the fastest training variant so far (relayrl's kernel options: IS_DIVISIBLE, EXPAND_KV)
TRAIN=(--only train --train-variants "${TRAIN_VARIANTS:-$B,$B+opt=tiles-64,$B+opt=divisible,$B+opt=expand-kv-n1-64,\
$B+graphs}")

say() {  # say CMD...: run it, or with DRY=1 print it (shell-quoted), one line
  if [[ -n "${DRY:-}" ]]; then printf '%q ' "$@"; echo; else "$@"; fi
}

if [[ -z "${DRY:-}" && -d .whl ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || exit 1
fi
if [[ -z "${DRY:-}" ]]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
fi

tests() {
  echo "== CUDA tests"
  say timeout "$TEST_S" python3 -m pytest -q -p no:cacheprovider $TEST_FILES ${TESTS:+-k "$TESTS"} 2>&1 \
    | tee "$OUT/tests.log" | tail -25
}

run() {  # run NAME TREE LIMIT ARGS...: one part of gpu.py from TREE (. or $OLD), its last lines shown, all logged
  local name=$1 tree=$2 limit=$3; shift 3
  echo "== $name ($tree)"
  say timeout "$limit" python3 "$tree/benchmarks/gpu.py" "$@" 2>&1 \
    | tee "$OUT/$name.log" | grep -v "^\s*$" | tail -40
}

for part in $PARTS; do
  case $part in
    tests) tests ;;
    decode)
      run decode . "${DECODE_S:-$PART_S}" "${DECODE[@]}" ${TRACE:+--trace "$OUT/trace"} ${DECODE_ARGS:-}
      [[ -n "${OLD:-}" ]] && run decode-old "$OLD" "${DECODE_S:-$PART_S}" --only decode --decode-sizes 256 \
        --compile-decode --no-decode-baselines ;;
    profile) run profile . "$PART_S" --only profile --compile-decode ;;
    flex) run flex . "${FLEX_S:-$PART_S}" --only flex ${FLEX_ARGS:-} ;;
    train)
      run train . "${TRAIN_S:-$PART_S}" "${TRAIN[@]}" ${TRAIN_ARGS:-}
      [[ -n "${OLD:-}" ]] && run train-old "$OLD" "${TRAIN_S:-$PART_S}" "${TRAIN[@]}" ;;
    moe)  # MoE routing replay on the GPU: bf16 rollout, bf16 mixed-precision trainer (benchmarks/routing_replay.py)
      echo "== moe"
      say timeout "${MOE_S:-$PART_S}" python3 benchmarks/routing_replay.py --device cuda --train-compute bfloat16 \
        --prompts 64 --max-new-tokens 256 2>&1 | tee "$OUT/moe.log" | grep -v "^\s*$" | tail -8 ;;
    *) echo "gpu_session: unknown part $part (tests, flex, train, decode, profile, moe)"; exit 2 ;;
  esac
done
echo "== done"
