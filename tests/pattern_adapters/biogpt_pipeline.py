"""A pipeline-only adapter for BioGPT (no transformers tp plan): its decoder calls the learned position embedding
as ``embed_positions(attention_mask, past_length, position_ids=...)``, so the later stage's stand-in for it
must take that call. Declares no tp or sp: the kit shows what that leaves proven."""

from plait import AdapterInfo, Capabilities, PipelinePlan, TPPlan, hookimpl


@hookimpl
def plait_adapter_info():
    return AdapterInfo(name="biogpt-pipeline", architectures=("biogpt",),
                       capabilities=Capabilities(tp=False, sp=False, pp=True, vpp=True, tied_embeddings=True))


@hookimpl
def plait_tp_plan(config):
    return TPPlan(())


@hookimpl
def plait_pipeline_plan(config):
    return PipelinePlan(first=("biogpt.embed_tokens", "biogpt.embed_positions"), layers="biogpt.layers",
                        last=("biogpt.layer_norm", "output_projection"), neutralize=("biogpt.embed_positions",))


@hookimpl
def plait_leaf_modules(config):
    return ["biogpt.layers.*"]


@hookimpl
def plait_tiny_config():
    from transformers import BioGptConfig

    return BioGptConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                        num_attention_heads=4, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, activation_dropout=0.0, layerdrop=0.0)
