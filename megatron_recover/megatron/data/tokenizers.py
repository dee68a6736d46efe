"""Tokenizers by Megatron's `--tokenizer-type` name, for preprocessing and for training.

Contract of `build_tokenizer(...)`: the returned object has
  tokenize(text) -> list[int]    the ids Megatron-LM's preprocessing writes for `text`
  detokenize(ids) -> str
  eod: int                       the end-of-document id (`--append-eod` appends it)
  vocab_size: int                the unpadded vocabulary size (eod included)
  unique_identifiers: OrderedDict  what megatron-core's datasets hash into their cache file names
which is everything megatron-core's GPTDataset and the preprocessing script need. The same
arguments give the same ids in every process; nothing is downloaded (paths must be local).

Types:
  GPT2BPETokenizer      vocab.json + merges.txt in GPT-2 format. Ours (`GPT2BPETokenizer` below):
                        megatron-core 0.16.1's class for this name asks the Hugging Face Hub for
                        "gpt2" and passes the vocab file where the merges file belongs, so it
                        cannot run offline. Ids equal Megatron-LM's `_GPT2BPETokenizer` for
                        files in GPT-2's format (merges.txt with its "#version" header line and a
                        final newline): byte-level BPE; special tokens in the text are not
                        parsed, so "<|endoftext|>" typed in a document is ordinary text. eod is
                        the id of "<|endoftext|>", vocab_size the number of vocab.json entries.
  HuggingFaceTokenizer  `tokenizer_model` is a local directory saved by transformers'
                        `save_pretrained`; megatron-core's own class (Megatron-LM's non-legacy
                        path): ids of `tokenizer.tokenize` + `convert_tokens_to_ids`, no
                        BOS/EOS added; eod is the tokenizer's eos token.
  SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer
                        `tokenizer_model` is a SentencePiece model file; megatron-core's
                        sentencepiece class, as Megatron-LM builds all three for its data and
                        its preprocessing (without --legacy-tokenizer): ids of the model's
                        `encode` with no BOS or EOS added (Megatron-LM's legacy Llama2 class
                        prepends BOS), eod is the model's eos piece, vocab_size its piece count.
  TikTokenizer          `tokenizer_model` is a tiktoken vocabulary in JSON (a list of {"rank",
                        "token_bytes", "token_str"}, the 256 single bytes first); megatron-core's
                        tiktoken class: ids are shifted up by `tiktoken_num_special_tokens`
                        (default 1000) reserved for `tokenizer_special_tokens` (default <unk> <s> </s>
                        <mask> <pad> <cls> <sep>, then <SPECIAL_i> fillers); special tokens in
                        the text are parsed; eod is </s>; `tiktoken_pattern` v1 or v2 (default)
                        selects the pre-tokenization regex; vocab_size (default 2**17) cuts the
                        JSON to its first `vocab_size - tiktoken_num_special_tokens` entries.
  NullTokenizer         megatron-core's own class: the text is space-separated integer ids;
                        eod = `vocab_size` and the vocabulary has `vocab_size + 1` entries.

`model_vocab_size` gives the vocabulary Megatron-LM pads for the model, which is the data's
except for SentencePieceTokenizer.
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
    NULL: (("vocab_size",), ()),
}
TOKENIZER_TYPES = tuple(ARGUMENTS)
TIKTOKEN_PATTERNS = ("v1", "v2")

# GPT-2's end-of-text token; Megatron-LM's GPT2BPE tokenizer uses it as the end-of-document id.
EOD_TOKEN = "<|endoftext|>"


class GPT2BPETokenizer:
    """Megatron-LM's GPT-2 BPE tokenizer from a vocab.json and a merges.txt, on `tokenizers`.

    Byte-level BPE with GPT-2's pre-tokenization regex and no prefix space, and no added tokens,
    so encoding matches the original GPT-2 encoder that Megatron-LM bundles.
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
    return _null_tokenizer(vocab_size)


def build_arguments(tokenizer_type: str, given: dict) -> dict:
    """The `build_tokenizer` keyword arguments of `tokenizer_type` from `given` (a superset, by
    argument name): the ones the type reads, less the optional ones that are None."""
    required, optional = ARGUMENTS[tokenizer_type]
    return {**{name: given[name] for name in required},
            **{name: given[name] for name in optional if given.get(name) is not None}}


def model_vocab_size(tokenizer_type: str, tokenizer) -> int:
    """The unpadded vocabulary size Megatron-LM gives the model (`padded_vocab_size` pads it).

    Megatron-LM sizes the model from its legacy tokenizer classes even where its data and its
    preprocessing use megatron-core's. They agree except for SentencePieceTokenizer, whose
    legacy class appends <CLS>, <SEP>, <EOD>, <MASK> and the pad, bos and eos pieces that the
    model lacks (<PAD>, <BOS>, <EOS> where the model has no such id) after its pieces.
    """
    if tokenizer_type != SENTENCE_PIECE:
        return tokenizer.vocab_size
    import sentencepiece

    model = sentencepiece.SentencePieceProcessor(model_file=tokenizer.path)
    pieces = {model.id_to_piece(i) for i in range(model.get_piece_size())}
    appended = {"<CLS>", "<SEP>", "<EOD>", "<MASK>"}
    for special_id, fallback in ((model.pad_id(), "<PAD>"), (model.bos_id(), "<BOS>"),
                                 (model.eos_id(), "<EOS>")):
        appended.add(model.id_to_piece(special_id)
                     if 0 <= special_id < model.get_piece_size() else fallback)
    return model.get_piece_size() + len(appended - pieces)


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
    # The fast tokenizer loads from tokenizer.json alone, which many saved tokenizers ship
    # without the slow tokenizer's files; both give the same ids.
    tokenizer = MegatronTokenizer.from_pretrained(
        tokenizer_path=os.path.abspath(tokenizer_model),
        metadata_path={"library": "huggingface"},
        use_fast=True,
    )
    if tokenizer.eod is None:
        raise ValueError(f"the tokenizer in {tokenizer_model} has no eos token to use as EOD")
    return tokenizer


def _sentence_piece_tokenizer(tokenizer_type: str, model_file: str):
    from megatron.core.tokenizers import MegatronTokenizer

    try:
        tokenizer = MegatronTokenizer.from_pretrained(
            tokenizer_path=model_file, metadata_path={"library": "sentencepiece"}
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
    kwargs = {"pattern": pattern} if pattern is not None else {}
    for name, keyword in (("vocab_size", "vocab_size"),
                          ("tiktoken_num_special_tokens", "num_special_tokens"),
                          ("tokenizer_special_tokens", "special_tokens")):
        if name in options:
            kwargs[keyword] = (list(options[name]) if keyword == "special_tokens"
                               else options[name])
    try:
        return MegatronTokenizer.from_pretrained(
            tokenizer_path=vocabulary_file, metadata_path={"library": "tiktoken"}, **kwargs
        )
    except (AssertionError, KeyError, ValueError, json.JSONDecodeError) as err:
        # megatron-core checks the vocabulary and the special tokens with assertions, most of
        # them without a message: name the check that failed.
        check = str(err) or traceback.extract_tb(err.__traceback__)[-1].line
        raise ValueError(
            f"TikTokenizer: {vocabulary_file} does not load with {kwargs or 'the defaults'}: "
            f"{type(err).__name__} {check!r}. The special tokens must be unique and include <unk> "
            "<s> </s> <mask> <pad> <cls> <sep>, with len(special tokens) <= "
            "--tiktoken-num-special-tokens < --vocab-size, and the file needs --vocab-size "
            "minus --tiktoken-num-special-tokens entries, ranks 0.. in order"
        ) from None


def _null_tokenizer(vocab_size: int):
    from megatron.core.tokenizers import MegatronTokenizer

    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"NullTokenizer needs --vocab-size >= 1, got {vocab_size!r}")
    return MegatronTokenizer.from_pretrained(
        metadata_path={"library": "null"}, vocab_size=vocab_size
    )
