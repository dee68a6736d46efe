"""Tokenizers by Megatron's `--tokenizer-type` name, for preprocessing and for training.

Contract of `build_tokenizer(...)`: the returned object has
  tokenize(text) -> list[int]    the ids Megatron-LM's preprocessing writes for `text`
  detokenize(ids) -> str
  eod: int                       the end-of-document id (`--append-eod` appends it)
  vocab_size: int                the unpadded vocabulary size (eod included), the model's too
  unique_identifiers: OrderedDict  what megatron-core's datasets hash into their cache file names
which is everything megatron-core's GPTDataset and the preprocessing script need. The same
arguments give the same ids in every process; nothing is downloaded (paths must be local).

Types, each as Megatron-LM core_v0.19.0 builds it (megatron-core's
`megatron/core/tokenizers/utils/build_tokenizer.py`, for its training and its preprocessing alike;
it has no legacy tokenizer classes any more), with the keyword arguments it passes at its
defaults:
  GPT2BPETokenizer      vocab.json + merges.txt in GPT-2 format. Ours (`GPT2BPETokenizer` below):
                        megatron-core 0.19's class for this name (library "megatron") still loads
                        `AutoTokenizer.from_pretrained("gpt2", vocab_file=..., merges_file=...)`,
                        which asks the Hugging Face Hub for "gpt2" and so cannot run offline.
                        Byte-level BPE as in GPT-2's original encoder; special tokens in the text
                        are not parsed, so "<|endoftext|>" typed in a document is ordinary text.
                        eod is the id of "<|endoftext|>", vocab_size the number of vocab.json
                        entries.
  HuggingFaceTokenizer  `tokenizer_model` is a local directory saved by transformers'
                        `save_pretrained`; megatron-core's class, fast tokenizer: ids are the
                        tokenizer's own encoding, `tokenizer(text).input_ids`, with the special
                        tokens its post-processor adds (a Llama tokenizer's BOS, for example, so
                        an empty text is [BOS]): megatron-core 0.19's `include_special_tokens`,
                        which Megatron-LM leaves on (core_v0.16.1 added none). Special tokens
                        typed in the text are parsed. eod is the eos token, vocab_size
                        `len(tokenizer)` (added tokens included).
  SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer
                        `tokenizer_model` is a SentencePiece model file; megatron-core's
                        sentencepiece class (not legacy, extra whitespace left to the model):
                        ids of the model's `encode`, no BOS or EOS added (Llama2Tokenizer too);
                        eod is the model's eos piece, vocab_size its piece count.
  TikTokenizer          `tokenizer_model` is a tiktoken vocabulary in JSON (a list of {"rank",
                        "token_bytes", "token_str"}, the 256 single bytes first); megatron-core's
                        tiktoken class: ids are shifted up by `tiktoken_num_special_tokens`
                        (default 1000) reserved for `tokenizer_special_tokens` (default <unk> <s> </s>
                        <mask> <pad> <cls> <sep>, then <SPECIAL_i> fillers); special tokens in
                        the text are parsed; eod is </s>; `tiktoken_pattern` v1 or v2 (default)
                        selects the pre-tokenization regex; vocab_size (default 2**17) cuts the
                        JSON to its first `vocab_size - tiktoken_num_special_tokens` entries.
  NullTokenizer         megatron-core's class (library "null-text"): the text is space-separated
                        integer ids; the vocabulary has `vocab_size` entries, eod is
                        `null_tokenizer_eod_id` (default `vocab_size - 1`, which must be below
                        vocab_size) and the pad id `null_tokenizer_pad_id` (default -1: none;
                        megatron-core's GPTDataset leaves labels equal to it out of the loss).
                        (megatron-core 0.16.1: `vocab_size + 1` entries, eod `vocab_size`.)

The model's unpadded vocabulary is the tokenizer's `vocab_size` for every type, as Megatron-LM
core_v0.19.0 sizes it (core_v0.16.1 took SentencePieceTokenizer's from its legacy class, which
appended pieces).
"""

import json
import os
import traceback
from collections import OrderedDict
from typing import List, Optional

GPT2_BPE = "GPT2BPETokenizer"
HUGGING_FACE = "HuggingFaceTokenizer"
SENTENCE_PIECE = "SentencePieceTokenizer"
GPT_SENTENCE_PIECE = "GPTSentencePieceTokenizer"
LLAMA2 = "Llama2Tokenizer"
TIKTOKEN = "TikTokenizer"
NULL = "NullTokenizer"
SENTENCE_PIECE_TYPES = (SENTENCE_PIECE, GPT_SENTENCE_PIECE, LLAMA2)
# The `build_tokenizer` arguments each type needs, then those it reads when given; it refuses
# the others. Each is named as its Megatron flag (`tokenizer_model`: --tokenizer-model).
ARGUMENTS = {
    GPT2_BPE: (("vocab_file", "merge_file"), ()),
    HUGGING_FACE: (("tokenizer_model",), ()),
    **{kind: (("tokenizer_model",), ()) for kind in SENTENCE_PIECE_TYPES},
    TIKTOKEN: (("tokenizer_model",),
               ("tiktoken_pattern", "vocab_size", "tiktoken_num_special_tokens",
                "tokenizer_special_tokens")),
    NULL: (("vocab_size",), ("null_tokenizer_eod_id", "null_tokenizer_pad_id")),
}
TOKENIZER_TYPES = tuple(ARGUMENTS)
TIKTOKEN_PATTERNS = ("v1", "v2")

# GPT-2's end-of-text token, GPT2BPETokenizer's end-of-document id (as in Megatron-LM).
EOD_TOKEN = "<|endoftext|>"


class GPT2BPETokenizer:
    """GPT-2 BPE from a local vocab.json and merges.txt, on `tokenizers`.

    Byte-level BPE with GPT-2's pre-tokenization regex and no prefix space, and no added tokens,
    so encoding matches GPT-2's original encoder (which Megatron-LM bundled up to core_v0.16.1 as
    its legacy GPT2BPETokenizer).
    """

    def __init__(self, vocab_file: str, merge_file: str):
        from tokenizers import ByteLevelBPETokenizer

        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
        if EOD_TOKEN not in vocab:
            raise ValueError(f"{vocab_file} has no {EOD_TOKEN!r} entry, GPT-2 BPE's EOD token")
        self._vocab_size = len(vocab)
        self._eod = vocab[EOD_TOKEN]
        self._tokenizer = ByteLevelBPETokenizer.from_file(vocab_file, merge_file)
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("tokenizer_path", [vocab_file, merge_file])]
        )

    def tokenize(self, text: str) -> List[int]:
        return self._tokenizer.encode(text).ids

    def detokenize(self, ids: List[int]) -> str:
        return self._tokenizer.decode(list(ids))

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def vocab_size(self) -> int:
        return self._vocab_size


def build_tokenizer(
    tokenizer_type: str,
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
    tokenizer_model: Optional[str] = None,
    vocab_size: Optional[int] = None,
    tiktoken_pattern: Optional[str] = None,
    tiktoken_num_special_tokens: Optional[int] = None,
    tokenizer_special_tokens: Optional[List[str]] = None,
    null_tokenizer_eod_id: Optional[int] = None,
    null_tokenizer_pad_id: Optional[int] = None,
):
    """The tokenizer Megatron's `--tokenizer-type` names; see the module docstring.

    Raises ValueError for an unknown type, a missing file, a tokenizer file its library cannot
    read, or an argument the type does not use (`ARGUMENTS` lists the used ones), so that a
    mistyped flag is not silently ignored.
    """
    if tokenizer_type not in ARGUMENTS:
        raise ValueError(
            f"unknown tokenizer type {tokenizer_type!r}; supported: {', '.join(TOKENIZER_TYPES)}"
        )
    given = {
        "vocab_file": vocab_file,
        "merge_file": merge_file,
        "tokenizer_model": tokenizer_model,
        "vocab_size": vocab_size,
        "tiktoken_pattern": tiktoken_pattern,
        "tiktoken_num_special_tokens": tiktoken_num_special_tokens,
        "tokenizer_special_tokens": tokenizer_special_tokens,
        "null_tokenizer_eod_id": null_tokenizer_eod_id,
        "null_tokenizer_pad_id": null_tokenizer_pad_id,
    }
    _check_arguments(tokenizer_type, given)
    if tokenizer_type == GPT2_BPE:
        return GPT2BPETokenizer(_existing_file(vocab_file), _existing_file(merge_file))
    if tokenizer_type == HUGGING_FACE:
        return _hugging_face_tokenizer(tokenizer_model)
    if tokenizer_type in SENTENCE_PIECE_TYPES:
        return _sentence_piece_tokenizer(tokenizer_type, _existing_file(tokenizer_model))
    if tokenizer_type == TIKTOKEN:
        options = {name: given[name] for name in ARGUMENTS[TIKTOKEN][1] if given[name] is not None}
        return _tiktoken_tokenizer(_existing_file(tokenizer_model), options)
    return _null_tokenizer(vocab_size, null_tokenizer_eod_id, null_tokenizer_pad_id)


def build_arguments(tokenizer_type: str, given: dict) -> dict:
    """The `build_tokenizer` keyword arguments of `tokenizer_type` from `given` (a superset, by
    argument name): the ones the type reads, less the optional ones that are None."""
    required, optional = ARGUMENTS[tokenizer_type]
    return {**{name: given[name] for name in required},
            **{name: given[name] for name in optional if given.get(name) is not None}}


def _check_arguments(tokenizer_type: str, given: dict) -> None:
    required, optional = ARGUMENTS[tokenizer_type]
    missing = [name for name in required if given[name] is None]
    if missing:
        raise ValueError(f"{tokenizer_type} needs {_flags(missing)}")
    unused = [name for name, value in given.items()
              if value is not None and name not in required + optional]
    if unused:
        raise ValueError(f"{tokenizer_type} does not use {_flags(unused)}; drop it")


def _flags(names) -> str:
    return ", ".join(flag(name) for name in names)


def flag(name: str) -> str:
    """The Megatron flag of a `build_tokenizer` argument."""
    return "--" + name.replace("_", "-")


def _existing_file(path: str) -> str:
    if not os.path.isfile(path):
        raise ValueError(f"tokenizer file not found: {path}")
    # Absolute, so that the dataset cache names hashed from it do not depend on the cwd.
    return os.path.abspath(path)


def _hugging_face_tokenizer(tokenizer_model: str):
    from megatron.core.tokenizers import MegatronTokenizer

    if not os.path.exists(tokenizer_model):
        raise ValueError(
            f"HuggingFaceTokenizer needs a local --tokenizer-model (a directory saved with "
            f"save_pretrained); {tokenizer_model!r} does not exist and nothing is downloaded"
        )
    # Megatron-LM's keyword arguments at its defaults: the fast tokenizer (which loads from
    # tokenizer.json alone), and ids with the special tokens the tokenizer adds.
    tokenizer = MegatronTokenizer.from_pretrained(
        tokenizer_path=os.path.abspath(tokenizer_model),
        metadata_path={"library": "huggingface"},
        chat_template=None, vocab_file=None, merges_file=None, additional_special_tokens=[],
        use_fast=True, trust_remote_code=False, include_special_tokens=True,
    )
    if tokenizer.eod is None:
        raise ValueError(f"the tokenizer in {tokenizer_model} has no eos token to use as EOD")
    return tokenizer


def _sentence_piece_tokenizer(tokenizer_type: str, model_file: str):
    from megatron.core.tokenizers import MegatronTokenizer

    try:
        # Megatron-LM's keyword arguments at its defaults.
        tokenizer = MegatronTokenizer.from_pretrained(
            tokenizer_path=model_file, metadata_path={"library": "sentencepiece"},
            chat_template=None, ignore_extra_whitespaces=True, legacy=False, special_tokens=None,
        )
    except (RuntimeError, OSError) as err:  # sentencepiece's message for a file it cannot parse
        raise ValueError(f"{tokenizer_type}: --tokenizer-model {model_file} is not a "
                         f"SentencePiece model ({err})") from None
    if tokenizer.eod < 0:
        raise ValueError(
            f"{tokenizer_type}: the SentencePiece model {model_file} has no eos piece, which "
            "Megatron uses as the end-of-document id: train it with an eos id (sentencepiece's "
            "default, --eos_id=2)"
        )
    return tokenizer


def _tiktoken_tokenizer(vocabulary_file: str, options: dict):
    from megatron.core.tokenizers import MegatronTokenizer

    pattern = options.get("tiktoken_pattern")
    if pattern is not None and pattern not in TIKTOKEN_PATTERNS:
        raise ValueError(f"TikTokenizer: --tiktoken-pattern {pattern!r}: choose v1 or v2")
    if not vocabulary_file.endswith(".json"):
        raise ValueError(f"TikTokenizer: --tokenizer-model {vocabulary_file} must be the "
                         "vocabulary's .json file (a list of rank, token_bytes, token_str)")
    # Megatron-LM's keyword arguments: pattern and vocab_size only when given (the class's
    # defaults v2 and 2**17 otherwise), the others always.
    kwargs = {"chat_template": None}
    if pattern is not None:
        kwargs["pattern"] = pattern
    if "vocab_size" in options:
        kwargs["vocab_size"] = options["vocab_size"]
    kwargs["num_special_tokens"] = options.get("tiktoken_num_special_tokens", 1000)
    special_tokens = options.get("tokenizer_special_tokens")
    kwargs["special_tokens"] = None if special_tokens is None else list(special_tokens)
    try:
        return MegatronTokenizer.from_pretrained(
            tokenizer_path=vocabulary_file, metadata_path={"library": "tiktoken"}, **kwargs
        )
    except (AssertionError, KeyError, ValueError, json.JSONDecodeError) as err:
        # megatron-core checks the vocabulary and the special tokens with assertions, most of
        # them without a message: name the check that failed.
        check = str(err) or traceback.extract_tb(err.__traceback__)[-1].line
        given = {k: v for k, v in kwargs.items() if v is not None}
        raise ValueError(
            f"TikTokenizer: {vocabulary_file} does not load with {given}: "
            f"{type(err).__name__} {check!r}. The special tokens must be unique and include <unk> "
            "<s> </s> <mask> <pad> <cls> <sep>, with len(special tokens) <= "
            "--tiktoken-num-special-tokens < --vocab-size, and the file needs --vocab-size "
            "minus --tiktoken-num-special-tokens entries, ranks 0.. in order"
        ) from None


def _null_tokenizer(vocab_size: int, eod_id: Optional[int], pad_id: Optional[int]):
    from megatron.core.tokenizers import MegatronTokenizer

    if not _is_int(vocab_size) or vocab_size < 1:
        raise ValueError(f"NullTokenizer needs --vocab-size >= 1, got {vocab_size!r}")
    # Megatron-LM does not check the EOD id; one outside the vocabulary has no embedding row
    # (and the preprocessing could not store it).
    if eod_id is not None and (not _is_int(eod_id) or not 0 <= eod_id < vocab_size):
        raise ValueError(f"NullTokenizer: --null-tokenizer-eod-id must be an id of the "
                         f"vocabulary, 0..{vocab_size - 1} (--vocab-size {vocab_size}), "
                         f"got {eod_id!r}")
    if pad_id is not None and not _is_int(pad_id):
        raise ValueError(f"NullTokenizer: --null-tokenizer-pad-id must be an integer, "
                         f"got {pad_id!r}")
    # Megatron-LM's keyword arguments: eod_id only when given, pad_id always (default -1).
    kwargs = {"vocab_size": vocab_size}
    if eod_id is not None:
        kwargs["eod_id"] = eod_id
    kwargs["pad_id"] = -1 if pad_id is None else pad_id
    return MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"}, **kwargs)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
