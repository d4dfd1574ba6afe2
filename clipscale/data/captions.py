"""Captions to token ids in one native call a piece: open_clip's CLIP tokenizer, by `instant-clip-tokenizer`.

open_clip's `SimpleTokenizer` is pure Python, 70-90 us a caption: a fifth of a loader worker's
time per sample. `instant-clip-tokenizer` (Rust) holds the same vocabulary and merges and gives a
piece's ids in one call, about 4 us a caption. It lower-cases but does not clean: open_clip first
applies ftfy's fixes and unescapes HTML entities twice. On printable ASCII without `&` that cleaning
changes only whitespace, which the word pattern skips anyway, so only the other captions
(non-ASCII, entities, control characters) are cleaned in Python, by open_clip's own function.
A caption naming a special token (`<end_of_text>`) goes to open_clip itself.
tests/data/test_captions.py compares every id with open_clip's on thousands of varied captions.

    tokenize = CaptionTokenizer.of(open_clip.get_tokenizer("ViT-B-32"))   # or that tokenizer itself
    tokens = tokenize(captions)    # int64 [n, context_length], as open_clip's
"""

from __future__ import annotations

import re

import torch
from open_clip.tokenizer import SimpleTokenizer, _clean_lower

# What open_clip's cleaning leaves as it is, but for whitespace runs and case (see the module doc).
PLAIN = re.compile(r"[\x20-\x25\x27-\x7e\t\n\r]*")
VOCABULARY = 49408  # open_clip's default byte-level BPE (bpe_simple_vocab_16e6), the one the native tokenizer holds


def native_tokenizer():
    import instant_clip_tokenizer

    return instant_clip_tokenizer.Tokenizer()


class CaptionTokenizer:
    """open_clip's `SimpleTokenizer(clean="lower")` ids for a list of captions, in one native call."""

    def __init__(self, tokenizer: SimpleTokenizer):
        self.slow, self.native = tokenizer, native_tokenizer()
        self.context_length = tokenizer.context_length
        self.specials = tuple(token for token, index in tokenizer.encoder.items() if index in tokenizer.all_special_ids)

    def __getstate__(self) -> dict:  # a loader worker started by spawn builds its own native tokenizer
        return {**self.__dict__, "native": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, native=native_tokenizer())

    @classmethod
    def of(cls, tokenizer):
        """The native tokenizer for open_clip's default CLIP tokenizer; any other tokenizer as it is."""
        if (type(tokenizer) is not SimpleTokenizer or tokenizer.reduction_fn is not None
                or tokenizer.clean_fn is not _clean_lower or len(tokenizer.encoder) != VOCABULARY):
            return tokenizer
        return cls(tokenizer)

    def __call__(self, texts: str | list[str], context_length: int | None = None) -> torch.Tensor:
        texts = [texts] if isinstance(texts, str) else list(texts)
        context = context_length or self.context_length
        cleaned = [text if PLAIN.fullmatch(text) else _clean_lower(text) for text in texts]
        tokens = torch.from_numpy(self.native.tokenize_batch(cleaned, context).astype("int64"))
        by_open_clip = [k for k, text in enumerate(cleaned) if any(special in text.lower() for special in self.specials)]
        if by_open_clip:
            tokens[by_open_clip] = self.slow([texts[k] for k in by_open_clip], context_length=context)
        return tokens
