"""How text becomes the tokens that are scored.

The query is encoded with the tokenizer's special tokens (a BOS, where the tokenizer adds one) and
each item without, and the scored sequence is query_tokens + item_tokens (item_tokens +
query_tokens with item_first=True). This can differ from tokenizing the concatenated string: BPE
may merge across the boundary (query "ab" + item "c" can encode as ["a", "bc"] when joined). We
tokenize the pieces separately on purpose: the query tokens are then the same for every item,
which is what lets faster backends process the query once and share it, and every backend scores
exactly the same tokens. An item suffix (`item_suffix=`) is tokenized once, on its own, and its
tokens appended to every item's, for the same reason.
"""

from __future__ import annotations

import tokenizers


def encode_query(tokenizer: tokenizers.Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=True).ids


def encode_items(tokenizer: tokenizers.Tokenizer, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]


def encode_label(tokenizer: tokenizers.Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def encode_suffix(tokenizer: tokenizers.Tokenizer, text: str) -> list[int]:
    """An item suffix, tokenized once on its own and appended to every item's tokens: the
    items' tokens then end the same way whatever they hold."""
    return tokenizer.encode(text, add_special_tokens=False).ids


def cut_to_tokens(tokenizer: tokenizers.Tokenizer, texts: list[str], max_tokens: int) -> list[str]:
    """Each text cut to the characters of its first max_tokens tokens, tokenized on its own
    (as an item is, without special tokens). A text of at most max_tokens UTF-8 bytes cannot
    have more tokens and is not tokenized."""
    long = [i for i, text in enumerate(texts) if len(text.encode("utf-8")) > max_tokens]
    cut = list(texts)
    encodings = tokenizer.encode_batch([texts[i] for i in long], add_special_tokens=False)
    for i, encoding in zip(long, encodings, strict=True):
        if len(encoding.ids) > max_tokens:
            cut[i] = texts[i][: encoding.offsets[max_tokens - 1][1]]
    return cut
