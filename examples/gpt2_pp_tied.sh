#!/usr/bin/env bash
# GPT2 with pipeline parallelism over 2 processes: the tied wte / lm_head lives on both pipeline ends and
# its gradients are summed, so both copies stay identical.
set -euo pipefail
plait train --nproc_per_node 2 --pipeline_parallel_size 2 --num_microbatches 4 --pipeline_schedule 1f1b \
  --model_config examples/configs/tiny-gpt2.json \
  --max_steps 200 --per_device_train_batch_size 8 --block_size 128 --learning_rate 1e-3 \
  --output_dir runs/gpt2-pp "$@"
