#!/usr/bin/env bash
# Every drafting family decodes exactly on a sliding-window target past its window: each family
# is trained briefly on TARGET (default gemma3-270m: sliding window 512 on 5 of every 6 layers,
# a 262,144-token vocabulary), then all of them decode held-out prompts of about 700-900 tokens
# greedy in fp32 beside plain decoding, in one scripts/evaluate.py run, so that every verification
# attends past the window. The check is that each one's output equals plain decoding's
# (`matches ar` in OUT/eval/report.md); acceptance after so little training is not the point.
#
#   scripts/window_check.sh                     # OUT=runs/window-check, 30 steps a family
#   STEPS=100 FAMILIES="eagle medusa" scripts/window_check.sh
#
# Each family trains on its demo config (configs/KIND/demo.yaml) with the data replaced by the
# demo corpus's standard-library source as plain text (a base model has no chat template), rows
# of LENGTH tokens, evaluation on that text, no end-of-run measurement. OUT/FAMILY.log holds each
# run's printout (peak memory among it), OUT/eval/report.md the decoding. Exit status 1 where a
# family's output differs from plain decoding's.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${TARGET:-gemma3-270m}
OUT=${OUT:-runs/window-check}
STEPS=${STEPS:-30}
LENGTH=${LENGTH:-256}
FAMILIES=${FAMILIES:-"distill eagle peagle dflash medusa layerskip"}
PROMPTS=${PROMPTS:-4}
NEW_TOKENS=${NEW_TOKENS:-96}
PROMPT_LINES=${PROMPT_LINES:-120}  # 90 lines made 423-728 Gemma tokens
mkdir -p "$OUT"

drafters=()
for family in $FAMILIES; do
    start=$(date +%s)
    python "train/$family.py" target="$TARGET" output_dir="$OUT/$family" max_steps="$STEPS" \
        data.path=demo data.format=text data.pack=false data.max_length="$LENGTH" \
        data.max_samples=2000 \
        micro_batch_size=1 grad_accum=1 warmup_steps=2 eval_every="$STEPS" eval_batches=4 \
        eval_on=corpus save_every=0 eval_loop.enabled=false report_to=none \
        2>&1 | tr '\r' '\n' | grep -v "it/s" > "$OUT/$family.log"
    echo "window_check.sh: $family trained in $(($(date +%s) - start)) s (log: $OUT/$family.log)"
    drafters+=(--drafter "$OUT/$family/final")
done

# Held-out prompts of PROMPT_LINES lines of standard-library source, each ending at a `def`.
python -c "import json, sys; from specdraft.data.stdlib_corpus import demo_prompts; \
json.dump(demo_prompts(int(sys.argv[1]), lines=int(sys.argv[2])), open(sys.argv[3], 'w'))" \
    "$PROMPTS" "$PROMPT_LINES" "$OUT/prompts.json"
python scripts/evaluate.py --target "$TARGET" --dtype float32 "${drafters[@]}" --baselines ar \
    --prompts "$OUT/prompts.json" --num-prompts "$PROMPTS" --max-new-tokens "$NEW_TOKENS" \
    --temperature 0 --output "$OUT/eval" 2>&1 | tee "$OUT/eval.log"
python - "$OUT/eval/report.json" "$TARGET" "$OUT/prompts.json" <<'EOF'
import json
import sys

from specdraft.measuring.measure import read_prompts
from specdraft.targets.target import load_target

report = json.load(open(sys.argv[1]))
target = load_target(sys.argv[2])
window = getattr(target.model.config, "sliding_window", None)
lengths = [p.shape[1] for p in read_prompts(sys.argv[3], 1000, target.tokenizer)]
print(f"window_check.sh: sliding window {window}; prompts of {lengths} tokens")
# plain decoding is the reference: of the base target, and of a fine-tuned one (LayerSkip's
# model, whose drafter is checked against that model's own plain output)
bad = [r["label"] for r in report["runs"] if r["method"] != "ar" and not r.get("matches_ar")]
for r in report["runs"]:
    print(f"  {r['label']:<12} {r['name']:<40} tau {r['tau']:.2f}  matches ar {r.get('matches_ar')}")
print(f"window_check.sh: {'outputs differ from plain decoding: ' + ', '.join(bad) if bad else 'every drafter decoded as plain decoding'}")
sys.exit(1 if bad else 0)
EOF
