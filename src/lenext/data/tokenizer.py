"""The tokenizer: lenext's byte-level BPE trained on a bounded sample of the training split, or one from outside
(``data.tokenizer``: a tokenizer.json or a Hugging Face tokenizer folder), set to encode whole documents; and each
token's UTF-8 bytes, for bits per byte."""

import math
import os
from collections.abc import Iterable, Iterator

import numpy as np

from lenext.errors import ConfigError, first_line

EOS = "<|endoftext|>"


# The end-of-text tokens a tokenizer.json may name, for one that comes without a tokenizer config.
END_OF_TEXT = (EOS, "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")


# The files a tokenizer folder holds one of (fast, SentencePiece, BPE, WordPiece): without any, transformers' own
# reason is a sentence cut at its first line ("... from one of: ").
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")


def for_documents(tokenizer):
    """``tokenizer`` (a tokenizers.Tokenizer) set to encode whole documents: no saved truncation or padding (they
    would cut or pad them), and text that spells a special token ("<|endoftext|>", web text holds it) encoded as
    text, so that the start token marks document starts only."""
    tokenizer.no_truncation()
    tokenizer.no_padding()
    tokenizer.encode_special_tokens = True
    return tokenizer


def token_id_bound(tokenizer) -> int:
    """The embedding rows a tokenizer's ids need: its largest id + 1 (an outside tokenizer's ids need not be dense)."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


def external_tokenizer(path: str, key: str = "data.tokenizer"):
    """(tokenizers.Tokenizer, document start token id) of ``data.tokenizer`` (or the setting ``key`` that gave
    ``path``): a tokenizer.json, or a Hugging Face tokenizer folder (its fast tokenizer; its BOS, else its EOS,
    starts each document)."""
    from tokenizers import Tokenizer

    where = f"{key}={path!r}"
    if os.path.isfile(path):
        try:
            tokenizer = Tokenizer.from_file(path)
        except Exception as e:  # tokenizers raises its own Exception for a file that is not a tokenizer
            raise ConfigError(f"{where} cannot be read as a tokenizer.json ({first_line(e)})") from None
        encodes(for_documents(tokenizer), where)
        start = end_of_text(tokenizer)
        if start is None:
            raise ConfigError(
                f"{where} has none of the end-of-text tokens {', '.join(END_OF_TEXT)}: lenext starts each document "
                "with one; give the tokenizer's folder (its config names its BOS/EOS) instead"
            )
        return tokenizer, start
    if not os.path.isdir(path):
        raise ConfigError(f"{where} does not exist: give a tokenizer.json or a Hugging Face tokenizer folder")
    if not any(os.path.exists(os.path.join(path, name)) for name in TOKENIZER_FILES):  # else transformers makes one
        raise ConfigError(f"{where} holds no tokenizer transformers can load (none of {', '.join(TOKENIZER_FILES)})")
    from transformers import AutoTokenizer

    try:
        loaded = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        if "trust_remote_code" in str(e):
            raise ConfigError(f"{where}: its tokenizer's code is in the folder, which lenext does not run") from None
        raise ConfigError(f"{where} holds no tokenizer transformers can load ({first_line(e)})") from None
    if not loaded.is_fast:
        raise ConfigError(f"{where}: its tokenizer has no fast (tokenizers) version, which lenext tokenizes with")
    start = loaded.bos_token_id if loaded.bos_token_id is not None else loaded.eos_token_id
    if start is None:  # a folder of a tokenizer.json alone: its end-of-text token, as for the file
        start = end_of_text(loaded.backend_tokenizer)
    if start is None:
        raise ConfigError(
            f"{where}: its tokenizer names neither a BOS nor an EOS token to start documents with, and has none of "
            f"{', '.join(END_OF_TEXT)}"
        )
    return encodes(for_documents(loaded.backend_tokenizer), where), start


def encodes(tokenizer, where: str):
    """``tokenizer``, or a ConfigError naming ``where`` if it cannot encode text (a WordLevel vocabulary without its
    unknown token fails on the first word it lacks, mid-preparation)."""
    try:
        tokenizer.encode("lenext checks: a word it lacks, zzqxj 0123 ü 日本", add_special_tokens=False)
    except Exception as e:  # tokenizers raises its own Exception
        raise ConfigError(f"{where} cannot encode text ({first_line(e)}): give a tokenizer that can") from None
    return tokenizer


def end_of_text(tokenizer) -> int | None:
    """The id of the first of ``END_OF_TEXT`` the tokenizer has, or None."""
    return next((tokenizer.token_to_id(t) for t in END_OF_TEXT if tokenizer.token_to_id(t) is not None), None)


def byte_ends(text: str, offsets: list[tuple[int, int]]) -> np.ndarray:
    """Per token, the UTF-8 bytes of ``text`` up to the end of the characters its ``offsets`` span (never fewer
    than the token before's): token i's bytes are byte_ends[i] - byte_ends[i - 1]."""
    points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    widths = 1 + (points >= 0x80) + (points >= 0x800) + (points >= 0x10000)
    char_ends = np.concatenate([[0], np.cumsum(widths)])  # byte offset of each character boundary
    ends = np.fromiter((end for _, end in offsets), dtype=np.int64, count=len(offsets))
    return np.maximum.accumulate(char_ends[ends]) if len(ends) else ends


def train_tokenizer(documents: Iterable[str], vocab_size: int):
    """Byte-level BPE (GPT-2 style) trained on ``documents``; EOS is token 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return tokenizer


def sample(documents: Iterable[str], megabytes: float | None) -> Iterator[str]:
    """The first documents of ``documents`` up to ``megabytes`` of UTF-8 text (the one that crosses the bound
    included; None: all of them)."""
    budget = math.inf if megabytes is None else megabytes * 1e6
    for document in documents:
        if budget <= 0:
            return
        budget -= len(document.encode())  # bytes, not characters (up to 4 bytes each)
        yield document
