"""plait adapter for transformers' OPT (facebook/opt-125m ... opt-66b), which declares no tp plan of its own.

Every fact plait needs about the architecture, one hook each (plait.plugin.hookspecs has the reference):
- the tensor-parallel plan: attention split by heads (q, k, v column-parallel, out_proj row-parallel), the MLP's
  fc1 column- and fc2 row-parallel, the vocabulary split in the embedding and the head (tied by default);
- the sequence-parallel region: from the first decoder layer to the decoder's final norm, with the LayerNorms
  inside it named (their gradients are summed over tp). OPT's layer flattens its hidden states to
  [tokens, hidden] before fc1; plait's sequence-parallel gather follows that layout, so nothing is declared for it;
- the pipeline plan: what runs before the layers (token and learned position embeddings, ``project_in`` in the
  350m variant) and after them (final norm, ``project_out``, head); later stages neutralise the position
  embedding, whose output is added to the token embedding's;
- the leaf modules (the decoder layers), OPT's own weight init (``init_std``, not ``initializer_range``), and a
  tiny config for the conformance kit.
"""

from plait import AdapterInfo, Attention, Column, PipelinePlan, Row, SPPlan, TPPlan, VocabEmbedding, VocabHead, hookimpl

LAYERS = "model.decoder.layers"


@hookimpl
def plait_adapter_info():
    return AdapterInfo(name="opt", architectures=("opt", "OPTForCausalLM"))


@hookimpl
def plait_tp_plan(config):
    heads = config.num_attention_heads
    return TPPlan((
        # OPTAttention reshapes q/k/v with self.num_heads, set from the config at init: give it this rank's count.
        Attention(f"{LAYERS}.*.self_attn", q="q_proj", k="k_proj", v="v_proj", o="out_proj", num_heads=heads,
                  num_kv_heads=heads, head_dim=config.hidden_size // heads, local_attrs={"num_heads": "q_heads"}),
        Column(f"{LAYERS}.*.fc1"),
        Row(f"{LAYERS}.*.fc2"),
        VocabEmbedding("model.decoder.embed_tokens"),
        VocabHead("lm_head"),
    ))


def _decoder_ends(config) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The decoder's modules before and after its layers; some exist only in some OPT sizes."""
    projected = config.word_embed_proj_dim != config.hidden_size  # opt-350m: embeddings narrower than the layers
    final_norm = config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False)
    before = ("model.decoder.embed_tokens", "model.decoder.embed_positions",
              *(("model.decoder.project_in",) if projected else ()))
    after = (*(("model.decoder.final_layer_norm",) if final_norm else ()),
             *(("model.decoder.project_out",) if projected else ()))
    return before, after


@hookimpl
def plait_sp_plan(config):
    _, after = _decoder_ends(config)
    return SPPlan(begin=f"{LAYERS}.0", end=after[0],
                  norms=(f"{LAYERS}.*.self_attn_layer_norm", f"{LAYERS}.*.final_layer_norm", "model.decoder.final_layer_norm"))


@hookimpl
def plait_pipeline_plan(config):
    before, after = _decoder_ends(config)
    return PipelinePlan(first=before, layers=LAYERS, last=(*after, "lm_head"),
                        neutralize=("model.decoder.embed_positions",))


@hookimpl
def plait_leaf_modules(config):
    return [f"{LAYERS}.*"]


@hookimpl
def plait_init_weight(name, tensor, config, generator):
    # OPTPreTrainedModel._init_weights: normal(0, init_std) for linear and embedding weights; OPT configs have no
    # initializer_range, so plait's default would use its fallback std instead.
    if tensor.dim() == 2:
        tensor.normal_(0.0, config.init_std, generator=generator)
        return True
    return None


@hookimpl
def plait_tiny_config():
    from transformers import OPTConfig

    # Dropout 0 (OPT's default is 0.1): the kit compares exact losses. 4 heads, so tp=2 and tp=4 split them.
    return OPTConfig(vocab_size=64, hidden_size=32, word_embed_proj_dim=32, ffn_dim=64, num_hidden_layers=4,
                     num_attention_heads=4, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                     activation_dropout=0.0, layerdrop=0.0, pad_token_id=1, bos_token_id=2, eos_token_id=2)
