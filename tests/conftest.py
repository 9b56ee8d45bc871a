"""Shared fixtures: a byte-level BPE tokenizer trained in the test session and a tiny random
causal LM built from a config, so no test needs a model hub or network."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIALS = ["<pad>", "<eos>", "<|user|>", "<|assistant|>", "<|system|>"]


def build_tokenizer(chat_template=CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on a few strings: decode(encode(s)) == s for any text."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [
        "What is 12 + 34? Answer with just the number.",
        "The answer is 46. #### 46",
        "minus -17 and 1,024 and 3.5 dollars $",
    ] * 20
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.add_special_tokens({"additional_special_tokens": SPECIALS[2:]})
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


def build_tiny_model(path, tokenizer, seed: int = 0) -> str:
    """A 2-layer Llama with random weights (head_dim 64, which vLLM's CPU attention supports)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def make_tokenizer():
    """Factory for tokenizers with a different (or no) chat template."""
    return build_tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"), tiny_tokenizer)
