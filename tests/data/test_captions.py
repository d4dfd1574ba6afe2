"""The native caption tokenizer (clipscale/data/transforms.py) against open_clip's SimpleTokenizer:
every id equal on thousands of captions that mix what web alt-text holds (HTML entities, curly
quotes, accents, CJK, emoji, ligatures, control characters, odd whitespace, keyword lists longer
than the context, the special tokens' names)."""

from __future__ import annotations

import random

import open_clip
import torch

from clipscale.data.transforms import CaptionTokenizer

FRAGMENTS = [
    "a", "photo", "of", "the", "Dog's", "don't", "they'll", "I'm", "we've", "T-shirt", "#sale", "@home", "50%", "3.14",
    "2024", "x2", "C++", "e-mail", "U.S.A.", "...", "!!", "(new)", "[hd]", "{x}", "a/b", "x_y", "~ok~", "^^", "|", "`q`",
    "&amp;", "&lt;b&gt;", "&quot;hi&quot;", "&#39;", "&nbsp;", "&amp;amp;", "AT&T", "&", "R&D",
    "café", "naïve", "Ünïcödé", "İstanbul", "Straße", "ÉCOLE", "ﬁne", "Ｆｕｌｌ", "½", "²", "€10", "£5", "¥", "©", "™",
    "“quoted”", "‘single’", "don’t", "—", "–", "…", "«guillemets»", "日本語", "中文字", "한국어", "Привет", "Ελλάδα", "עברית",
    "العربية", "हिन्दी", "ไทย", "🍕", "👍🏽", "👨‍👩‍👧", "🇫🇷", "❤️", "\u200b", "\u00a0", "\u3000", "\x07", "\x00", "\x1b[31m", "\x7f",
    "\t", "\n", "\r\n", "  ", "<end_of_text>", "<start_of_text>", "<END_OF_TEXT>", "<b>", "</p>",
]


def captions(count: int, seed: int) -> list[str]:
    pick = random.Random(seed)
    out = []
    for _ in range(count):
        words = pick.choice((pick.randint(1, 12), pick.randint(12, 40), pick.randint(60, 140)))
        glue = pick.choice((" ", " ", " ", "", "  ", "\t"))
        out.append(glue.join(pick.choice(FRAGMENTS) for _ in range(words)))
    return out


def test_native_ids_equal_open_clips_on_varied_captions():
    slow = open_clip.get_tokenizer("ViT-B-32")
    fast = CaptionTokenizer.of(slow)
    assert isinstance(fast, CaptionTokenizer)
    texts = captions(4000, seed=0)
    want, got = slow(texts), fast(texts)
    different = [texts[k] for k in range(len(texts)) if not torch.equal(want[k], got[k])]
    assert not different, f"{len(different)} captions differ, e.g. {different[:3]!r}"
    assert (want[:, -1] != 0).sum() > 100  # many are cut at the context length, as open_clip cuts them
    assert torch.equal(slow(texts[:50], context_length=78), fast(texts[:50], context_length=78))
    assert torch.equal(slow("one caption"), fast("one caption"))


def test_other_tokenizers_are_kept_as_they_are():
    custom = open_clip.tokenizer.SimpleTokenizer(clean="whitespace")
    assert CaptionTokenizer.of(custom) is custom
    stand_in = lambda texts: torch.zeros(len(texts), 77)  # noqa: E731
    assert CaptionTokenizer.of(stand_in) is stand_in
