"""Reasoning steps of a response: where each ends, in characters and in tokens.

A response is split at its step separator (a run of separators counts as one). A step runs up to
and including the separator that closes it, so its reward sits on the token holding that
separator's last character; the last step ends at the response's end. A step-tag scorer reads
a copy of the response with a tag written after each step's text (`tag_steps`).
"""

from __future__ import annotations

import re


def step_ends(text: str, separator: str) -> list[int]:
    """Character offsets (exclusive) where the steps of `text` end; none for blank text."""
    ends = [m.end() for m in re.finditer(f"(?:{re.escape(separator)})+", text) if text[:m.start()].strip()]
    if text[ends[-1] if ends else 0:].strip():
        ends.append(len(text))
    elif ends:  # only separators or blanks after the last separator: that step ends at the text's end
        ends[-1] = len(text)
    return ends


def decoded_prefix_lengths(tokenizer, ids: list[int]) -> list[int]:
    """The length of the text decoded from the first k + 1 tokens, for each k (special tokens
    skipped, as responses are decoded for scoring)."""
    return [len(tokenizer.decode(ids[:k + 1], skip_special_tokens=True)) for k in range(len(ids))]


def token_at(token_ends: list[int], char_end: int) -> int:
    """The first token whose text reaches `char_end` (`token_ends`: each token's end offset,
    non-decreasing); the last token when none does."""
    return next((k for k, end in enumerate(token_ends) if end >= char_end), len(token_ends) - 1)


def tag_steps(text: str, ends: list[int], separator: str, tag: str) -> tuple[str, list[int]]:
    """`text` with `tag` written after each step's text (before the separators that close it, as
    in "step one ки\nstep two ки"), and where each tag ends in the tagged text."""
    tagged, tag_ends, start = "", [], 0
    for end in ends:
        step = text[start:end]
        body = step
        while body.endswith(separator):
            body = body[:-len(separator)]
        tagged += body + tag
        tag_ends.append(len(tagged))
        tagged += step[len(body):]
        start = end
    return tagged, tag_ends
