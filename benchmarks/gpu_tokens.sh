#!/usr/bin/env bash
# Token drops on a lent GPU, in one call (issue 49): the CUDA tests, then `dropbp bench` token-level and
# branch-level step times against their ideals (SmolLM2-135M's shape, random weights: step time does not depend on
# the weights, and the pretrained file is too large to carry), LoRA and full fine-tuning, checkpointing off and on,
# then `dropbp check` on the same model. STAGES="large" times the 1b and 7b presets instead (steps the device, not
# the host, may bound). Expects SmolLM2's config.json in $SMOL_CONFIG (a folder); writes into $RESULTS and, after
# every stage, a tarball of it into $OUT (what a killed call still returns).
set -uo pipefail
source "$(dirname "$0")/gpu_setup.sh"
for stage in ${STAGES:-tests bench check}; do
  case "$stage" in
    tests)
      python3 -P -m pytest -q -p no:cacheprovider tests/test_token_drops.py tests/test_backends.py -k "cuda or gpu" \
        2>&1 | tee "$RESULTS/gpu_tests.log" | tail -15 ;;
    bench)
      for run in "lora off" "full off" "lora on" "full on"; do
        set -- $run; name=$1; [ "$2" = on ] && name=${1}_checkpointing
        python3 -P -m dropbp bench --backend cuda --model /tmp/smollm2-random --methods "$1" --checkpointing "$2" \
          --rates 0.3 0.5 0.75 --patterns tokens uniform --seq-lens 512 --batch-sizes 8 --rounds 10 --warmup 3 \
          --out "$RESULTS/bench_tokens_cuda/$name" > "$RESULTS/bench_$name.log" 2>&1 || tail -20 "$RESULTS/bench_$name.log"
        cat "$RESULTS/bench_tokens_cuda/$name/bench.md" 2>/dev/null | head -12
        pack "bench $name"
      done ;;
    large)  # where the device, not the host, may bound a step: TinyLlama-1.1B's shape and a 7B layer shape
      for preset in 1b 7b; do
        python3 -P -m dropbp bench --backend cuda --presets "$preset" --methods lora full --rates 0.5 0.75 \
          --patterns tokens uniform --seq-lens 2048 --batch-sizes 4 --rounds 6 --warmup 2 \
          --out "$RESULTS/bench_tokens_cuda_large/$preset" > "$RESULTS/bench_$preset.log" 2>&1 || tail -20 "$RESULTS/bench_$preset.log"
        cat "$RESULTS/bench_tokens_cuda_large/$preset/bench.md" 2>/dev/null | head -16
        pack "bench $preset"
      done ;;
    check)
      python3 -P -m dropbp check --backend cuda --model /tmp/smollm2-random --method lora --quick \
        --out "$RESULTS/check_cuda" > "$RESULTS/check.log" 2>&1 || tail -20 "$RESULTS/check.log"
      tail -25 "$RESULTS/check_cuda/check.md" 2>/dev/null ;;
  esac
  pack "$stage"
done
