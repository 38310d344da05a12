"""A tiny transformers-style decoder that no installed adapter knows, and an in-process adapter for it
that gives leaf modules but no pipeline plan: pipeline parallelism must come from plait's fallback
(docs/decisions.md D4: the ModuleList holding the leaf modules is the repeated part)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_outputs import CausalLMOutput

from plait import AdapterInfo, Capabilities, Column, Row, TPPlan, hookimpl


class TinyConfig(PretrainedConfig):
    model_type = "tiny-decoder"

    def __init__(self, vocab_size=61, hidden_size=32, num_layers=4, num_heads=4, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.num_layers, self.num_heads = num_layers, num_heads


class TinyBlock(nn.Module):
    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.heads = config.num_heads
        self.norm1, self.norm2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, h = hidden_states.shape
        q, k, v = self.qkv(self.norm1(hidden_states)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, s, h)
        hidden_states = hidden_states + self.proj(attn)
        return hidden_states + self.fc2(F.gelu(self.fc1(self.norm2(hidden_states))))


class TinyDecoder(nn.Module):
    """Embedding, a ModuleList of blocks, final norm, head; builds its causal + padding mask itself."""

    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(TinyBlock(config) for _ in range(config.num_layers))
        self.norm = nn.LayerNorm(config.hidden_size)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids=None, inputs_embeds=None, attention_mask=None, use_cache=None) -> CausalLMOutput:
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        s = hidden.shape[1]
        mask = torch.ones(s, s, dtype=torch.bool, device=hidden.device).tril()[None, None]
        if attention_mask is not None:
            # keys that are padding are hidden, but every query still sees itself (no empty softmax rows)
            own = torch.eye(s, dtype=torch.bool, device=hidden.device)
            mask = mask & (attention_mask.bool()[:, None, None, :] | own)
        for block in self.blocks:
            hidden = block(hidden, mask)
        return CausalLMOutput(logits=self.head(self.norm(hidden)))


class TinyAdapter:
    """Leaf modules only: no plait_pipeline_plan hook."""

    @hookimpl
    def plait_adapter_info(self):
        return AdapterInfo(name="tiny-decoder", architectures=("tiny-decoder",),
                           capabilities=Capabilities(sp=False, tied_embeddings=False))

    @hookimpl
    def plait_tp_plan(self, config):
        return TPPlan((Column("blocks.*.fc1"), Row("blocks.*.fc2")))

    @hookimpl
    def plait_leaf_modules(self, config):
        return ["blocks.*"]
