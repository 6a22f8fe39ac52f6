"""The embedded model's tokenizer: a byte-level BPE trained with `tokenizers` on the corpus's text,
with names, identifiers and digits spelled a character a token (so copying a value the model has
never seen is copying from a small alphabet), wrapped as a transformers fast tokenizer carrying
the engine's default chat template."""

from __future__ import annotations

from typing import Any

from freetoken_agents.engine import DEFAULT_CHAT_TEMPLATE

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAG_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# A character inside a capitalised word or a snake_case identifier. Oniguruma lookbehind must
# have a fixed length per alternative, hence one alternative per position (words up to 16 letters).
_AFTER_CAPITAL = "|".join(r"\b[A-Z]" + "[a-z]" * k for k in range(16))
_AFTER_UNDERSCORE = "|".join("_" + "[a-z0-9]" * k for k in range(16))
# Upper-case letters (tickers, codes, "CA") and non-ASCII characters are alone too, so a value in
# another script is copied character by character (its bytes, when BPE never merged them).
NAME_CHARACTERS = (
    rf"(?<={_AFTER_CAPITAL}|{_AFTER_UNDERSCORE})[a-z0-9]|[a-z](?=[a-z0-9]*_)|_|[A-Z]|[^\x00-\x7f]"
)


def train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    """Byte-level BPE (digits split one by one, so unseen numbers are copied digit by digit),
    wrapped as a transformers fast tokenizer carrying the engine's default chat template."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            # The space before a name or an identifier is a token of its own, so a name is the same
            # tokens in a question ("of Kavonbou"), a JSON string ('"Kavonbou"') and code ("def
            # get_x" vs "`get_x`").
            pre_tokenizers.Split(Regex(r"\s(?=[A-Z]|[A-Za-z0-9]+_)"), behavior="isolated"),
            # Names (capitalised words) and identifiers (words with "_") are spelled one character
            # a token, like digits: copying them is then copying from a 40-symbol alphabet. With
            # BPE pieces (~1,500 rare name tokens) a model trained here copied digits perfectly and
            # names not at all (loss on a name piece = uniform over name pieces).
            pre_tokenizers.Split(Regex(NAME_CHARACTERS), behavior="isolated"),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[AddedToken(t, special=True) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=DEFAULT_CHAT_TEMPLATE,
        model_max_length=2048,
    )


def character_tokenizer() -> Any:
    """A tokenizer of no vocabulary: renders text before the real tokenizer is trained (rendering a
    dialogue does not depend on the vocabulary)."""
    from tokenizers import Tokenizer, models

    return Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
