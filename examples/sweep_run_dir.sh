#!/usr/bin/env bash
# Evaluate every checkpoint of a training run directory, then the same as a watching sweep would.
#
#   python examples/train_with_eval_hook.py            # a toy training run: writes train_with_eval_hook_out/checkpoints/
#   bash examples/sweep_run_dir.sh [RUN_DIR] [OUT_DIR]  # defaults: that run directory, sweep_run_dir_out
#
# RUN_DIR holds nanotron <step>/ folders (+ latest.txt), Megatron iter_XXXXXXX/ folders, or HF checkpoint-N/ /
# step_N/ folders. Re-running the same command skips checkpoints already scored with the same tasks and settings.
set -euo pipefail
RUN_DIR="${1:-train_with_eval_hook_out/checkpoints}"
OUT_DIR="${2:-sweep_run_dir_out}"
TASKS="demo|arithmetic|0,demo|arithmetic_gen|3,demo|arithmetic_ppl|0"
if [ ! -d "$RUN_DIR" ]; then
    echo "no run directory at $RUN_DIR: run 'python examples/train_with_eval_hook.py' first, or pass one" >&2
    exit 2
fi

# One pass over what is there now: every checkpoint from step 300 on, 100 documents per task.
# Writes OUT_DIR/<checkpoint>/results.json, OUT_DIR/sweep_results.{csv,parquet}, OUT_DIR/report/index.html.
nano_eval sweep "$RUN_DIR" --tasks "$TASKS" --output-dir "$OUT_DIR" --max-samples 100 --min-step 300

# Watch mode, on 2 data-parallel ranks, as you would run it beside a training job: poll every 10 s, score each new
# finished checkpoint (those already scored above are skipped by their evaluation identity), log into an offline
# W&B run on the training-step axis, and stop once a checkpoint at or past --until-step is done (or on Ctrl-C /
# SIGTERM). Against a live run, set --until-step to its last step and add --wandb-run-id to log into its W&B run.
LAST_STEP=$(ls "$RUN_DIR" | sed -n 's/^step_\([0-9]*\)$/\1/p' | sort -n | tail -n 1)
torchrun --nproc_per_node=2 "$(dirname "$0")/../nano_eval/run.py" sweep "$RUN_DIR" --tasks "$TASKS" --output-dir "$OUT_DIR" \
    --max-samples 100 --min-step 300 --watch --poll-s 10 --until-step "${LAST_STEP:-0}" \
    --wandb-project nano_eval_example --wandb-mode offline
