"""A small byte-level BPE with a ChatML chat template, trained locally: for SFT examples and tests, which
must not download a tokenizer. Real runs use the model's own tokenizer (--tokenizer_name / the model dir)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

EOS, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

# ChatML, as Qwen and SmolLM use it; the assistant turn ends with <|im_end|>, which is trained on, so
# generation learns to stop there.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def chat_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A BPE of at most ``vocab_size`` tokens trained on ``texts`` (deterministic), with the ChatML special
    tokens and template; ``<|im_end|>`` is its eos (what generation stops at) and ``<|endoftext|>`` its pad."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=IM_END, pad_token=EOS)
    fast.chat_template = CHATML_TEMPLATE
    return fast


def save_chat_tokenizer(texts: Iterable[str], vocab_size: int, directory: str | Path) -> Path:
    """``chat_tokenizer`` saved as a tokenizer dir (tokenizer.json + tokenizer_config.json with the template)."""
    directory = Path(directory)
    chat_tokenizer(texts, vocab_size).save_pretrained(directory)
    return directory
