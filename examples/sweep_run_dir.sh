#!/usr/bin/env bash
# Evaluate every checkpoint of a training run directory, then keep watching it while training goes on.
#
#   bash examples/sweep_run_dir.sh RUN_DIR [OUT_DIR]
#
# RUN_DIR holds nanotron <step>/ folders (+ latest.txt), Megatron iter_XXXXXXX/ folders, or HF checkpoint-N/ /
# step_N/ folders. Re-running the same command skips checkpoints already scored with the same tasks and settings.
set -euo pipefail
RUN_DIR="${1:?usage: $0 RUN_DIR [OUT_DIR]}"
OUT_DIR="${2:-sweep_out}"
TASKS="demo|arithmetic|0,demo|arithmetic_gen|3,demo|arithmetic_ppl|0"

# One pass over what is there now: every 2nd checkpoint from step 100 on, 200 documents per task.
# Writes OUT_DIR/<checkpoint>/results.json, OUT_DIR/sweep_results.{csv,parquet}, OUT_DIR/report/index.html.
nano_eval sweep "$RUN_DIR" --tasks "$TASKS" --output-dir "$OUT_DIR" --max-samples 200 --every 2 --min-step 100

# Watch mode, on 2 data-parallel ranks: poll every 60 s, evaluate each new finished checkpoint, log it into the
# training run's W&B run (resumed by id) on the training-step axis, stop after step 10000 or on Ctrl-C / SIGTERM.
torchrun --nproc_per_node=2 nano_eval/run.py sweep "$RUN_DIR" --tasks "$TASKS" --output-dir "$OUT_DIR" \
    --max-samples 200 --watch --poll-s 60 --until-step 10000 \
    --wandb-project my-project --wandb-run-id "${WANDB_RUN_ID:-}" --tokens-per-step 524288
