#!/usr/bin/env bash
# dropbp 0.3's core on a lent GPU, in one call: the CUDA tests and the new surface's tests, `dropbp check` (the
# on-device self-check), then `dropbp bench` of branch drops at 0.5 and 0.875 (cut and uniform), checkpointing off
# and on, at the 1b and 7b presets (where the device, not the host, bounds a step). Expects SmolLM2's config.json in
# $SMOL_CONFIG (a folder); writes into $RESULTS and, after every stage, a tarball of it into $OUT.
set -uo pipefail
source "$(dirname "$0")/gpu_setup.sh"
for stage in ${STAGES:-tests check large}; do
  case "$stage" in
    tests)
      python3 -P -m pytest -q -p no:cacheprovider tests/test_surface.py tests/test_token_drops.py tests/test_backends.py \
        -k "cuda or gpu or surface or moved or lean or feature or auto or pointer" 2>&1 | tee "$RESULTS/gpu_tests.log" | tail -8 ;;
    check)
      python3 -P -m dropbp check --backend cuda --model /tmp/smollm2-random --method lora --quick \
        --out "$RESULTS/check_cuda" > "$RESULTS/check.log" 2>&1 || tail -20 "$RESULTS/check.log"
      tail -25 "$RESULTS/check_cuda/check.md" 2>/dev/null ;;
    large)
      for preset in 1b 7b; do
        python3 -P -m dropbp bench --backend cuda --presets "$preset" --methods lora full --rates 0.5 0.875 \
          --patterns cut uniform --seq-lens 2048 --batch-sizes 4 --rounds 6 --warmup 2 --checkpointing both \
          --out "$RESULTS/bench_cuda_$preset" > "$RESULTS/bench_$preset.log" 2>&1 || tail -20 "$RESULTS/bench_$preset.log"
        head -30 "$RESULTS/bench_cuda_$preset/bench.md" 2>/dev/null
        pack "bench $preset"
      done ;;
  esac
  pack "$stage"
done
