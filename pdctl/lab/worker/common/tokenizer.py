"""The gRPC stand-ins' tokenizer (vLLM's, and SGLang's in --grpc-mode), which SMG fetches with
GetTokenizer (no internet in the lab; docs/facts.md, vLLM gRPC workers).

A Hugging Face ``tokenizer.json`` (WordPiece on whitespace-split words) and a
``tokenizer_config.json`` with a chat template, made here with the standard library, and the
same encoding and decoding in Python: SMG renders and tokenizes the prompt with these files,
the stand-in reads the prompt's ids and answers with ids SMG detokenizes to its words.

Every whitespace-separated word of printable ASCII round-trips: a word in the vocabulary is
one id, any other is spelled with character pieces (``h ##e ##y``). A word counts as one token
for ``max_tokens`` and usage, as in the SGLang HTTP stand-in (common/words.py).
"""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from collections.abc import Iterable

SPECIAL = ("<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>")
UNK, BOS, EOS = 0, 1, 2
USER = SPECIAL.index("<|user|>")
PREFIX = "##"
_CHARS = [chr(c) for c in range(33, 127)]
# Words the stand-in says often, as one id each (any other word still round-trips).
_WORDS = ("echo:", "prefill", "decode", "regular", "model=", "the", "a", "hello", "world")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MAX_WORD_CHARS = 100


def _build_vocab() -> dict[str, int]:
    pieces = [*SPECIAL, *_CHARS, *(PREFIX + c for c in _CHARS), *_WORDS]
    return {piece: index for index, piece in enumerate(dict.fromkeys(pieces))}


VOCAB = _build_vocab()
_BY_ID = {index: piece for piece, index in VOCAB.items()}
# What words are spelled with: a word that looks like a special token is spelled, not marked.
_PIECES = {piece: index for piece, index in VOCAB.items() if index >= len(SPECIAL)}


def _word_ids(word: str) -> list[int]:
    """WordPiece's greedy longest-match-first, as the tokenizers library runs it."""
    if len(word) > MAX_WORD_CHARS:
        return [UNK]
    ids, start = [], 0
    while start < len(word):
        end, found = len(word), None
        while start < end:
            piece = word[start:end] if start == 0 else PREFIX + word[start:end]
            # A word that itself starts with "##" must not open with a continuation piece:
            # decoded, it would stick to the word before ("##0" came back as "0").
            if piece in _PIECES and not (start == 0 and piece.startswith(PREFIX)):
                found = _PIECES[piece]
                break
            end -= 1
        if found is None:
            return [UNK]
        ids.append(found)
        start = end
    return ids


def encode_words(text: str) -> list[list[int]]:
    """Each whitespace-separated word's ids (the stand-in's text holds no special token)."""
    return [_word_ids(word) for word in text.split()]


def decode(ids: Iterable[int]) -> str:
    """The WordPiece decoder's text, special tokens skipped (SMG's default)."""
    text = ""
    for index in ids:
        piece = _BY_ID.get(index)
        if piece is None or index < len(SPECIAL):
            continue
        if piece.startswith(PREFIX):
            text += piece[len(PREFIX) :]
        else:
            text += (" " if text else "") + piece
    return text


def last_user_message(ids: list[int]) -> str:
    """The text of the prompt's last user turn (the chat template marks it), else all of it."""
    starts = [i for i, index in enumerate(ids) if index == USER]
    if not starts:
        return decode(ids)
    turn = []
    for index in ids[starts[-1] + 1 :]:
        if index < len(SPECIAL):
            break
        turn.append(index)
    return decode(turn)


def tokenizer_json() -> str:
    added = [
        {
            "id": index,
            "content": piece,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for index, piece in enumerate(SPECIAL)
    ]
    return json.dumps(
        {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": added,
            "normalizer": None,
            "pre_tokenizer": {"type": "WhitespaceSplit"},
            "post_processor": None,
            "decoder": {"type": "WordPiece", "prefix": PREFIX, "cleanup": False},
            "model": {
                "type": "WordPiece",
                "unk_token": SPECIAL[UNK],
                "continuing_subword_prefix": PREFIX,
                "max_input_chars_per_word": MAX_WORD_CHARS,
                "vocab": VOCAB,
            },
        },
        indent=1,
    )


def tokenizer_config_json(max_model_len: int) -> str:
    return json.dumps(
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": SPECIAL[BOS],
            "eos_token": SPECIAL[EOS],
            "unk_token": SPECIAL[UNK],
            "add_bos_token": False,
            "add_eos_token": False,
            "model_max_length": max_model_len,
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        },
        indent=1,
    )


def bundle(max_model_len: int) -> tuple[bytes, str]:
    """GetTokenizer's ZIP archive (the files at its root, fixed timestamps) and its SHA-256."""
    buffer = io.BytesIO()
    files = {
        "tokenizer.json": tokenizer_json(),
        "tokenizer_config.json": tokenizer_config_json(max_model_len),
    }
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, text in files.items():
            archive.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), text)
    data = buffer.getvalue()
    return data, hashlib.sha256(data).hexdigest()
