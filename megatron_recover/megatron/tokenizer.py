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
  NullTokenizer         megatron-core's own class: the text is space-separated integer ids;
                        eod = `vocab_size` and the vocabulary has `vocab_size + 1` entries.
"""

import json
import os
from collections import OrderedDict
from typing import List, Optional

GPT2_BPE = "GPT2BPETokenizer"
HUGGING_FACE = "HuggingFaceTokenizer"
NULL = "NullTokenizer"
# The `build_tokenizer` arguments each type needs; it refuses the others.
ARGUMENTS = {
    GPT2_BPE: ("vocab_file", "merge_file"),
    HUGGING_FACE: ("tokenizer_model",),
    NULL: ("vocab_size",),
}
TOKENIZER_TYPES = tuple(ARGUMENTS)

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
):
    """The tokenizer Megatron's `--tokenizer-type` names; see the module docstring.

    Raises ValueError for an unknown type, a missing file, or an argument the type does not use
    (`ARGUMENTS` lists the used ones), so that a mistyped flag is not silently ignored.
    """
    if tokenizer_type not in ARGUMENTS:
        raise ValueError(
            f"unknown tokenizer type {tokenizer_type!r}; supported: {', '.join(TOKENIZER_TYPES)}"
        )
    _check_arguments(tokenizer_type, {
        "vocab_file": vocab_file,
        "merge_file": merge_file,
        "tokenizer_model": tokenizer_model,
        "vocab_size": vocab_size,
    })
    if tokenizer_type == GPT2_BPE:
        return GPT2BPETokenizer(_existing_file(vocab_file), _existing_file(merge_file))
    if tokenizer_type == HUGGING_FACE:
        return _hugging_face_tokenizer(tokenizer_model)
    return _null_tokenizer(vocab_size)


def _check_arguments(tokenizer_type: str, given: dict) -> None:
    required = ARGUMENTS[tokenizer_type]
    missing = [name for name in required if given[name] is None]
    if missing:
        flags = ", ".join("--" + name.replace("_", "-") for name in missing)
        raise ValueError(f"{tokenizer_type} needs {flags}")
    unused = [name for name, value in given.items() if value is not None and name not in required]
    if unused:
        flags = ", ".join("--" + name.replace("_", "-") for name in unused)
        raise ValueError(f"{tokenizer_type} does not use {flags}; drop it")


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


def _null_tokenizer(vocab_size: int):
    from megatron.core.tokenizers import MegatronTokenizer

    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"NullTokenizer needs --vocab-size >= 1, got {vocab_size!r}")
    return MegatronTokenizer.from_pretrained(
        metadata_path={"library": "null"}, vocab_size=vocab_size
    )
