#!/usr/bin/env bash
# A tiny Llama on the bundled corpus with tensor + sequence parallelism over 2 processes.
set -euo pipefail
plait train --nproc_per_node 2 --tensor_parallel_size 2 \
  --model_config examples/configs/tiny-llama.json \
  --max_steps 200 --per_device_train_batch_size 8 --block_size 128 \
  --learning_rate 1e-3 --lr_scheduler_type cosine --warmup_steps 20 \
  --output_dir runs/llama-tp-sp "$@"
