"""plait adapter for transformers' GPT2: Conv1D (transposed linear) layers, a fused q|k|v projection,
learned position embeddings and an LM head tied to the token embedding. It also claims model_type ``gpt-sw3``:
transformers maps it to GPT2Config and GPT2LMHeadModel, the same model."""

import math

from plait import AdapterInfo, Attention, Column, PipelinePlan, Row, SPPlan, TPPlan, VocabEmbedding, VocabHead, hookimpl


@hookimpl
def plait_adapter_info():
    return AdapterInfo(name="gpt2", architectures=("gpt2", "gpt-sw3", "GPT2LMHeadModel"))


@hookimpl
def plait_tp_plan(config):
    return TPPlan((
        Attention("transformer.h.*.attn", qkv="c_attn", o="c_proj",
                  num_heads=config.n_head, num_kv_heads=config.n_head, head_dim=config.n_embd // config.n_head,
                  # GPT2Attention splits c_attn's output by split_size (read from the config at init).
                  local_attrs={"split_size": "q_width", "num_heads": "q_heads", "embed_dim": "q_width"}),
        Column("transformer.h.*.mlp.c_fc"),
        Row("transformer.h.*.mlp.c_proj"),
        VocabEmbedding("transformer.wte"),
        VocabHead("lm_head"),
    ))


@hookimpl
def plait_sp_plan(config):
    return SPPlan(begin="transformer.h.0", end="transformer.ln_f",
                  norms=("transformer.h.*.ln_1", "transformer.h.*.ln_2", "transformer.ln_f"))


@hookimpl
def plait_pipeline_plan(config):
    return PipelinePlan(first=("transformer.wte", "transformer.wpe", "transformer.drop"), layers="transformer.h",
                        last=("transformer.ln_f", "lm_head"), neutralize=("transformer.wpe", "transformer.drop"))


@hookimpl
def plait_leaf_modules(config):
    return ["transformer.h.*"]


@hookimpl
def plait_tiny_config():
    from transformers import GPT2Config

    # Dropout 0: parity needs a deterministic forward. Embeddings are tied (GPT2's default); token ids
    # inside the small vocabulary.
    return GPT2Config(vocab_size=61, n_embd=32, n_layer=4, n_head=4, n_positions=64,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


@hookimpl
def plait_init_weight(name, tensor, config, generator):
    # GPT-2 paper / transformers' GPT2PreTrainedModel: residual projections are scaled by 1/sqrt(2 * n_layer).
    if name.endswith("c_proj.weight"):
        tensor.normal_(0.0, config.initializer_range / math.sqrt(2 * config.n_layer), generator=generator)
        return True
    return None
