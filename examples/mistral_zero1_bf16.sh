#!/usr/bin/env bash
# Mistral with ZeRO-1 over 2 data-parallel processes: bf16 parameters, fp32 master weights sharded with
# the optimizer state, clipping by the global gradient norm, activation checkpointing.
set -euo pipefail
plait train --nproc_per_node 2 --zero_1 --bf16 --optimizer_dtype float32 --max_grad_norm 1.0 \
  --gradient_checkpointing --model_config examples/configs/tiny-mistral.json \
  --max_steps 200 --per_device_train_batch_size 4 --block_size 128 --learning_rate 1e-3 \
  --output_dir runs/mistral-zero1 "$@"
