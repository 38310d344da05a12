"""The flags of ``plait train`` as data: their names, defaults and help (``TrainFlags``); what they mean together,
the checks before any process group, is ``plait.run.train_args.TrainArgs``, which adds to them no flag.

Names follow Hugging Face / optimum-neuron training scripts so existing launch scripts read naturally.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.base.config import CP_ATTENTION, FLOAT8_RECIPES
from plait.base.pipeline_schedules import DEFAULT_SCHEDULE, SCHEDULES
from plait.run.method_args import MethodArgs

LR_SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")
DATA_FORMATS = ("auto", "text", "chat", "prompt_completion", "vision")
LAYOUTS = ("manual", "auto")


@dataclass
class TrainFlags(MethodArgs):
    model_config: str | None = field(default=None, metadata={"help": "transformers config.json: random init"})
    model_name_or_path: str | None = field(default=None, metadata={"help": "a local Hugging Face model dir"})
    train_file: str | None = field(default=None, metadata={
        "help": ".txt, .jsonl, .parquet, a directory or a glob of them (text field: --text_field); default: bundled "
                "corpus"})
    output_dir: str = field(default="runs/plait", metadata={
        "help": "checkpoints, metrics.jsonl and loss.png go here: a directory, or an object store's URL "
                "(s3://bucket/run: plait[s3])"})
    tensor_parallel_size: int = field(default=1, metadata={"help": "tp: ranks that split each layer"})
    disable_sequence_parallel: bool = field(default=False, metadata={
        "help": "keep activations between TP regions whole"})
    disable_embedding_parallelization: bool = field(default=False, metadata={
        "help": "keep embeddings and LM head replicated"})
    per_device_train_batch_size: int = field(default=8, metadata={
        "help": "sequences per data-parallel rank per micro-step"})
    block_size: int = field(default=128, metadata={"help": "tokens per sequence"})
    learning_rate: float = field(default=1e-3, metadata={"help": "AdamW learning rate"})
    max_steps: int = field(default=100, metadata={"help": "optimizer steps"})
    seed: int = field(default=0, metadata={"help": "the same seed gives the same weights and data for every layout"})
    tokenizer_name: str | None = field(default=None, metadata={
        "help": "a local tokenizer dir (default: the model dir's, else a BPE trained on the data)"})
    dataset_name: str | None = field(default=None, metadata={
        "help": "a local `datasets` dir (save_to_disk) with a 'text' column"})
    validation_file: str | None = field(default=None, metadata={"help": ".txt or .jsonl for eval loss and perplexity"})
    eval_steps: int = field(default=0, metadata={
        "help": "evaluate every N steps (0: only at the end, if a validation file is given)"})
    eval_prompts: str | None = field(default=None, metadata={
        "help": "a .jsonl of prompts ('prompt' or chat 'messages') completed greedily at each evaluation, from the "
                "training layout's shards: into metrics.jsonl ('samples') and the --report_to trackers"})
    eval_max_new_tokens: int = field(default=32, metadata={"help": "new tokens of each --eval_prompts completion"})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "micro-steps per optimizer step"})
    weight_decay: float = field(default=0.0, metadata={
        "help": "AdamW weight decay, on matrices only (never biases or norm weights)"})
    exclude_embeddings_from_weight_decay: bool = field(default=False, metadata={
        "help": "do not decay token and position embeddings either"})
    lr_scheduler_type: str = field(default="linear", metadata={"help": f"one of {', '.join(LR_SCHEDULERS)}"})
    warmup_steps: int = field(default=0, metadata={"help": "linear warm-up steps"})
    context_parallel_size: int = field(default=1, metadata={
        "help": "cp: ranks that split every sequence (long contexts)"})
    cp_attention: str = field(default="auto", metadata={
        "help": f"attention across cp ranks: one of {', '.join(CP_ATTENTION)}"})
    expert_parallel_size: int = field(default=1, metadata={
        "help": "ep: ranks each MoE layer's experts are divided over, carved from the data-parallel (x cp) ranks"})
    disable_expert_tensor_parallel: bool = field(default=False, metadata={
        "help": "under tp, keep routed experts whole on every tp rank (each computes its own tokens) instead of "
                "splitting them"})
    moe_capacity_factor: float = field(default=0.0, metadata={
        "help": "under ep, cap the tokens a rank sends each expert at factor x its even share, dropping the rest "
                "(0: dropless)"})
    moe_aux_loss_scope: str = field(default="micro_batch", metadata={
        "help": "what the MoE router's load-balancing loss (output_router_logits) is computed over: micro_batch "
                "(transformers' definition: each forward's, averaged; its value depends on the layout) or "
                "global_batch (every token of the optimizer step, all micro-batches and ranks: the same for every "
                "layout; one extra forward per step)"})
    pipeline_parallel_size: int = field(default=1, metadata={
        "help": "pp: pipeline stages (ranks) the layers are cut into"})
    virtual_pipeline_size: int = field(default=1, metadata={
        "help": "model chunks per pipeline rank (interleaved schedules)"})
    num_microbatches: int = field(default=0, metadata={
        "help": "pipeline microbatches per micro-step (divides the per-device batch; 0: 1 without pp, with pp the "
                "smallest count >= pp the schedule accepts that divides the batch)"})
    pipeline_schedule: str = field(default=DEFAULT_SCHEDULE, metadata={"help": f"one of {', '.join(SCHEDULES)}"})
    pipeline_cuts: str | None = field(default=None, metadata={
        "help": "comma-separated leaf modules to cut after (default: balanced)"})
    zero_1: bool = field(default=False, metadata={
        "help": "shard optimizer state over data-parallel ranks (ZeRO-1; the same as --zero_stage 1)"})
    zero_stage: int = field(default=0, metadata={
        "help": "what to shard over the data-parallel ranks: 0 nothing, 1 optimizer state, 2 also gradients, 3 also "
                "parameters (2 and 3 on torch's FSDP2; with --bf16 the shards stay fp32 masters and layers compute "
                "in bf16)"})
    bf16: bool = field(default=False, metadata={"help": "bf16 parameters, with master weights in --optimizer_dtype"})
    bf16_autocast: bool = field(default=False, metadata={"help": "fp32 parameters, bf16 matmuls (torch.autocast)"})
    float8: str | None = field(default=None, metadata={
        "help": "EXPERIMENTAL (measured on an H200: 1.13x bf16's tokens/s for a 1B model, 0.49x for a 3B one with "
                "--gradient_checkpointing; experimental until that case is understood): compute the decoder layers' "
                "linear layers (attention and MLP projections; not the embeddings or LM head) in float8 with "
                f"torchao's recipe {' or '.join(FLOAT8_RECIPES)} (dynamic scales per tensor or per row; under tp, per "
                "shard); parameters, gradients and optimizer state keep their dtype (pair with --bf16); needs a GPU "
                "with float8 matmuls (compute capability 8.9+: L4, RTX 4090, H100, ...) and pip install "
                "'plait[float8]'"})
    float8_emulate: bool = field(default=False, metadata={
        "help": "with --float8: emulate the float8 matmuls (float8-rounded operands, fp32 products) on any device, "
                "for float8's numerics without its speed (CPU, tests, GPUs without float8)"})
    optimizer_dtype: str = field(default="float32", metadata={
        "help": "dtype of optimizer state and master weights: float32 or bfloat16"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "clip by the global gradient norm (0: no clipping)"})
    gradient_checkpointing: bool = field(default=False, metadata={
        "help": "recompute leaf modules (decoder layers) in backward"})
    attn_implementation: str | None = field(default=None, metadata={
        "help": "transformers attention kernel: eager, sdpa, flash_attention_2, ... (default: transformers' choice)"})
    torch_compile: bool = field(default=False, metadata={"help": "torch.compile each leaf module (decoder layer)"})
    save_steps: int = field(default=0, metadata={
        "help": "save a sharded checkpoint every N steps (0: only the final one, see --save_final)"})
    save_final: bool = field(default=True, metadata={
        "help": "save a checkpoint after the last step, ready for plait consolidate (--no_save_final: no save after "
                "the last step, unless --save_steps falls on it)"})
    save_async: bool = field(default=False, metadata={
        "help": "write each --save_steps checkpoint in the background while training goes on: each rank copies its "
                "part to host memory (its shard of the weights and optimizer state, see plait plan) and the next "
                "save, and the end of the run, wait for it; a crash mid-write leaves the previous checkpoint the "
                "newest"})
    save_total_limit: int = field(default=0, metadata={"help": "keep only the newest N checkpoints (0: keep all)"})
    save_on_signal: bool = field(default=True, metadata={
        "help": "on SIGTERM or a first SIGINT (Ctrl-C), finish the step and save a checkpoint before stopping "
                "(--no_save_on_signal: stop without saving)"})
    resume_from_checkpoint: str | None = field(default=None, metadata={
        "help": "a checkpoint dir, or 'auto': the newest complete one in output_dir"})
    logging_steps: int = field(default=1, metadata={
        "help": "print a log line every N steps when stderr is not a terminal (a terminal shows a progress bar; "
                "metrics.jsonl gets every step)"})
    report_to: str = field(default="none", metadata={
        "help": "comma-separated experiment trackers that get every step's metrics, as metrics.jsonl: none, "
                "tensorboard (event files in <output_dir>/tensorboard), wandb (project 'plait' or $WANDB_PROJECT; "
                "W&B's env vars apply, WANDB_MODE=offline among them), mlflow ($MLFLOW_TRACKING_URI, default "
                "sqlite:///<output_dir>/mlflow.db with its artifacts in <output_dir>/mlartifacts); each is a pip "
                "extra: pip install 'plait[wandb]'"})
    layout: str = field(default="manual", metadata={"help": "manual: the layout flags as given; auto: plait plan "
                        "--search picks tp, pp, cp, ep, SP, ZeRO-1, recomputation, the micro-batch size and the "
                        "accumulation steps for this run's model, global batch, block size and --nproc_per_node "
                        "processes on the detected device, prints its top 3 and why the first won, and trains with it"})
    nproc_per_node: int = field(default=1, metadata={
        "help": "launch this many processes with torchrun (when not already under torchrun)"})
    config: str | None = field(default=None, metadata={
        "help": "a TOML file whose keys are these flag names; flags override it"})
    device: str = field(default="auto", metadata={
        "help": "auto (the accelerator torch finds, else cpu), cpu, or any torch device type; an accelerator's bare "
                "type gets LOCAL_RANK as its index"})
    backend: str = field(default="auto", metadata={
        "help": "torch.distributed backend: auto (torch's default for the device type: gloo on cpu, nccl on NVIDIA "
                "GPUs, ...), or any backend name (gloo, nccl, xla, ...)"})
    ddp_timeout: int = field(default=600, metadata={"help": "seconds a collective may wait before the job fails"})
    max_restarts: int = field(default=0, metadata={
        "help": "plait launches its processes (--nproc_per_node, 1 too) under torchrun, which restarts every worker "
                "up to N times after one fails, and each restart resumes from the newest complete checkpoint by "
                "itself"})
    fault_tolerance: str = field(default="none", metadata={
        "help": "none, or torchft: this job is one replica group of a data-parallel run that keeps training when "
                "another group dies (--replica_group_id, --num_replica_groups, the lighthouse at "
                "$TORCHFT_LIGHTHOUSE; pip install 'plait[ft]')"})
    replica_group_id: int = field(default=0, metadata={
        "help": "--fault_tolerance torchft: this job's replica group, 0 to --num_replica_groups - 1 (it trains on "
                "that share of each global batch)"})
    num_replica_groups: int = field(default=1, metadata={
        "help": "--fault_tolerance torchft: how many replica groups share each global batch"})
    skip_nonfinite_steps: int = field(default=0, metadata={
        "help": "skip up to N steps whose loss or gradient norm is not finite (not applied, counted in metrics) "
                "before stopping (0: stop at the first)"})
    text_field: str = field(default="text", metadata={
        "help": "the text field of .jsonl lines, and the text column of Parquet files and --dataset_name"})
    data_cache_dir: str | None = field(default=None, metadata={
        "help": "where tokenized data and trained tokenizers are cached (default: $XDG_CACHE_HOME/plait, else "
                "~/.cache/plait)"})
    data_format: str = field(default="auto", metadata={
        "help": "auto, text (packed plain text), chat (.jsonl 'messages' or ShareGPT 'conversations', rendered with "
                "the tokenizer's chat template) prompt_completion (.jsonl 'prompt' + 'completion') or vision (TRL's "
                "image-text rows, 'messages' with image parts and 'images', .jsonl or .parquet, for an "
                "image-text-to-text model: its processor renders them); auto reads the first .jsonl line"})
    train_on_prompt: bool = field(default=False, metadata={
        "help": "SFT: train on prompt / user tokens too (default: only completion / assistant tokens count)"})
    packing: bool = field(default=False, metadata={
        "help": "SFT: pack several examples per block, attention kept within each (default: one example per block, "
                "padded); dpo, cpo, orpo: pack each micro-batch's pairs into rows of up to two --block_size, each "
                "pair's chosen and rejected side by side"})
    overlong: str = field(default="truncate", metadata={
        "help": "SFT examples longer than --block_size: truncate (keep the first block_size tokens), drop "
                "(truncate, and skip every example left with no token to train on) or refuse"})
    freeze_vision_tower: bool = field(default=False, metadata={
        "help": "an image-text-to-text model's vision tower (the encoder of the images) takes no step"})
    freeze_projector: bool = field(default=False, metadata={
        "help": "an image-text-to-text model's projector (what maps image features into the language model's width) "
                "takes no step"})
    lora_r: int = field(default=0, metadata={
        "help": "train LoRA adapters of this rank on the frozen model (0: train every parameter)"})
    lora_alpha: float = field(default=16.0, metadata={
        "help": "LoRA alpha: the update is scaled by alpha / r (peft's LoraConfig)"})
    lora_dropout: float = field(default=0.0, metadata={"help": "dropout on the LoRA input (peft's lora_dropout)"})
    lora_target_modules: str | None = field(default=None, metadata={
        "help": "comma-separated module names as peft takes them (default: the attention and MLP projections of the "
                "adapter's TP plan; '': none, with --lora_target_parameters)"})
    lora_target_parameters: str | None = field(default=None, metadata={
        "help": "comma-separated expert parameters as peft's target_parameters takes them, e.g. "
                "mlp.experts.gate_up_proj,mlp.experts.down_proj (routed experts' stacked weights; no --lora_dropout)"})
