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


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def make_tokenizer():
    """Factory for tokenizers with a different (or no) chat template."""
    return build_tokenizer
