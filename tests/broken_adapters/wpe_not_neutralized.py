"""The GPT2 adapter with a pipeline plan that forgets to neutralise the position embedding: GPT2Model's forward
calls ``wpe`` on every stage, so the later stage raises while the first waits for its gradient in a collective.
The pipeline modes fail on one rank only; every other mode is unaffected."""

from plait_gpt2 import plait_leaf_modules, plait_sp_plan, plait_tiny_config, plait_tp_plan  # noqa: F401

from plait import AdapterInfo, PipelinePlan, hookimpl


@hookimpl
def plait_adapter_info():
    return AdapterInfo(name="gpt2-wpe-not-neutralized", architectures=("gpt2",))


@hookimpl
def plait_pipeline_plan(config):
    return PipelinePlan(first=("transformer.wte", "transformer.wpe", "transformer.drop"), layers="transformer.h",
                        last=("transformer.ln_f", "lm_head"), neutralize=("transformer.drop",))
