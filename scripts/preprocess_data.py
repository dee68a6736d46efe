"""Megatron-LM's tools/preprocess_data.py, offline: JSONL documents -> megatron-core indexed data.

Usage: .venv/bin/python scripts/preprocess_data.py --input corpus.jsonl --output-prefix out/corpus
           --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt
           [--append-eod] [--workers N] [--json-keys text ...] [--log-interval N]
Other tokenizers (megatron_recover/megatron/data/tokenizers.py says what each writes):
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model LOCAL_DIR
  --tokenizer-type SentencePieceTokenizer|GPTSentencePieceTokenizer|Llama2Tokenizer
      --tokenizer-model MODEL_FILE
  --tokenizer-type TikTokenizer --tokenizer-model VOCAB.json [--tiktoken-pattern v1|v2]
      [--vocab-size V] [--tiktoken-num-special-tokens N] [--tokenizer-special-tokens T ...]
  --tokenizer-type NullTokenizer --vocab-size V [--null-tokenizer-eod-id E]
Ids are those Megatron-LM core_v0.19.0's preprocessing writes, from megatron-core's tokenizer
classes (GPT2BPETokenizer: our own class, GPT-2's byte-level BPE from the local files, since
megatron-core's asks the Hugging Face Hub); e.g. HuggingFaceTokenizer keeps the special tokens its
tokenizer adds (a Llama tokenizer's BOS), Llama2Tokenizer prepends no BOS.

Output, for each json key K: {prefix}_{K}_document.bin and .idx, written by megatron-core's
`IndexedDatasetBuilder` as Megatron-LM writes them, so `--data-path {prefix}_{K}_document` works
with any megatron-core GPTDataset:
- dtype `DType.optimal_dtype(tokenizer.vocab_size)` (uint16 below 65500 entries, else int32);
- one document per input line, in input order (the pool's `imap` keeps it). A string value is one
  sequence: the ids of `tokenizer.tokenize(text)`, then `tokenizer.eod` with --append-eod. A list
  of strings (sentence-split input) is one sequence per string that has ids, EOD on the last;
- a document without ids stays in the index as a document with no sequences, as in Megatron-LM.
Megatron-LM's --split-sentences, --partitions and worker-tuning flags are not offered. The input
is read with the `workers` processes of a multiprocessing pool (1 works; each worker builds its
own tokenizer). A bad line (invalid JSON, a missing key, a value that is not text, an id outside
the vocabulary) stops the run with a ValueError naming the line, and the partial output files
are removed.
"""

import argparse
import json
import multiprocessing
import os
import sys
import time

from megatron_recover.megatron.data.tokenizers import TOKENIZER_TYPES, build_tokenizer

# Lines handed to a pool worker at a time (Megatron-LM's value).
CHUNK_LINES = 32

# The pool worker's tokenizer, built once per worker process by `_init_worker`.
_worker_tokenizer = None


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--vocab-file", help="GPT2BPETokenizer: vocab.json")
    group.add_argument("--merge-file", help="GPT2BPETokenizer: merges.txt")
    group.add_argument("--tokenizer-model", help="HuggingFaceTokenizer: a local directory; the "
                       "SentencePiece types: the model file; TikTokenizer: the vocabulary .json")
    group.add_argument("--vocab-size", type=int, help="NullTokenizer: ids are 0..V-1, EOD is "
                       "V-1 (or --null-tokenizer-eod-id); TikTokenizer: the vocabulary size "
                       "(default 2**17)")
    group.add_argument("--tiktoken-pattern", choices=("v1", "v2"),
                       help="TikTokenizer: the pre-tokenization regex (default v2)")
    group.add_argument("--tiktoken-num-special-tokens", type=int,
                       help="TikTokenizer: ids reserved for special tokens (default 1000)")
    group.add_argument("--tokenizer-special-tokens", nargs="+",
                       help="TikTokenizer: the special tokens (default <unk> <s> </s> <mask> "
                       "<pad> <cls> <sep>)")
    group.add_argument("--null-tokenizer-eod-id", type=int,
                       help="NullTokenizer: the end-of-document id (default V-1)")
    group.add_argument("--null-tokenizer-pad-id", type=int,
                       help="NullTokenizer: the pad id (default -1, none; not written by "
                       "preprocessing, accepted as Megatron-LM's tool does)")
    group = parser.add_argument_group("input and output")
    group.add_argument("--input", required=True, help="JSONL file, one document a line")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="keys to extract from each line, one output data set per key")
    group.add_argument("--output-prefix", required=True,
                       help="output path without the _{key}_document.{bin,idx} suffix")
    group.add_argument("--append-eod", action="store_true",
                       help="append the end-of-document id to each non-empty document")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    group.add_argument("--log-interval", type=int, default=1000,
                       help="documents between progress lines on stderr")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be >= 1")
    if args.log_interval < 1:
        parser.error("--log-interval must be >= 1")
    return args


def tokenizer_arguments(args: argparse.Namespace) -> dict:
    """The keyword arguments of `build_tokenizer` that the command line gave."""
    given = {
        "vocab_file": args.vocab_file,
        "merge_file": args.merge_file,
        "tokenizer_model": args.tokenizer_model,
        "vocab_size": args.vocab_size,
        "tiktoken_pattern": args.tiktoken_pattern,
        "tiktoken_num_special_tokens": args.tiktoken_num_special_tokens,
        "tokenizer_special_tokens": args.tokenizer_special_tokens,
        "null_tokenizer_eod_id": args.null_tokenizer_eod_id,
        "null_tokenizer_pad_id": args.null_tokenizer_pad_id,
    }
    return {"tokenizer_type": args.tokenizer_type, **given}


def _init_worker(tokenizer_kwargs: dict) -> None:
    global _worker_tokenizer
    _worker_tokenizer = build_tokenizer(**tokenizer_kwargs)


def encode_document(tokenizer, line: str, json_keys, append_eod: bool) -> dict:
    """{key: (ids, sequence_lengths)} for one JSONL line, as Megatron-LM's Encoder.encode."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"invalid JSON ({err.msg})") from None
    if not isinstance(record, dict):
        raise ValueError("a line must hold a JSON object")
    encoded = {}
    for key in json_keys:
        if key not in record:
            raise ValueError(f"no {key!r} key (choose the keys with --json-keys)")
        value = record[key]
        sentences = value if isinstance(value, list) else [value]
        if not all(isinstance(sentence, str) for sentence in sentences):
            raise ValueError(f"{key!r} must be a string or a list of strings")
        ids, lengths = [], []
        for sentence in sentences:
            sentence_ids = tokenizer.tokenize(sentence)
            if sentence_ids:
                ids.extend(sentence_ids)
                lengths.append(len(sentence_ids))
        if ids and append_eod:
            ids.append(tokenizer.eod)
            lengths[-1] += 1
        _check_ids(ids, tokenizer.vocab_size)
        encoded[key] = (ids, lengths)
    return encoded


def _check_ids(ids, vocab_size: int) -> None:
    # The .bin dtype holds only ids below the vocabulary size; a NullTokenizer document can name
    # any integer, and a larger one would be stored wrapped around (or overflow).
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        raise ValueError(f"token id out of range [0, {vocab_size}): {min(ids)}..{max(ids)}")


class _LineEncoder:
    """The picklable task of a pool worker: encode one numbered line with the worker's tokenizer."""

    def __init__(self, json_keys, append_eod: bool):
        self.json_keys = list(json_keys)
        self.append_eod = append_eod

    def __call__(self, numbered_line):
        number, line = numbered_line
        try:
            encoded = encode_document(_worker_tokenizer, line, self.json_keys, self.append_eod)
        except ValueError as err:
            raise ValueError(f"line {number}: {err}") from None
        return encoded, len(line)


def output_prefix(prefix: str, key: str) -> str:
    """The data-set prefix (`--data-path`) written for one json key."""
    return f"{prefix}_{key}_document"


def main(argv=None) -> dict:
    """Run the preprocessing; return {key: (documents, tokens)} of what was written."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    args = parse_args(argv)
    tokenizer_kwargs = tokenizer_arguments(args)
    # Built here too, before any worker starts, so a bad tokenizer argument fails at once and
    # the output dtype is known.
    tokenizer = build_tokenizer(**tokenizer_kwargs)
    if not os.path.isfile(args.input):
        raise ValueError(f"--input not found: {args.input}")
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    prefixes = {key: output_prefix(args.output_prefix, key) for key in args.json_keys}
    builders = {key: IndexedDatasetBuilder(p + ".bin", dtype=dtype) for key, p in prefixes.items()}
    try:
        counts = _encode_all(args, tokenizer_kwargs, builders)
    except BaseException:
        _remove_outputs(builders, prefixes)
        raise
    for key, builder in builders.items():
        builder.finalize(prefixes[key] + ".idx")
        print(f"wrote {prefixes[key]}.{{bin,idx}}: {counts[key][0]} documents, "
              f"{counts[key][1]} tokens")
    return counts


def _encode_all(args, tokenizer_kwargs: dict, builders: dict) -> dict:
    counts = {key: [0, 0] for key in builders}
    start = time.monotonic()
    total_bytes = 0
    encoder = _LineEncoder(args.json_keys, args.append_eod)
    with open(args.input, encoding="utf-8") as lines, multiprocessing.Pool(
        args.workers, initializer=_init_worker, initargs=(tokenizer_kwargs,)
    ) as pool:
        documents = pool.imap(encoder, enumerate(lines, start=1), CHUNK_LINES)
        for number, (encoded, line_bytes) in enumerate(documents, start=1):
            for key, (ids, lengths) in encoded.items():
                builders[key].add_document(ids, lengths)
                counts[key][0] += 1
                counts[key][1] += len(ids)
            total_bytes += line_bytes
            if number % args.log_interval == 0:
                elapsed = time.monotonic() - start
                print(f"processed {number} documents ({number / elapsed:.0f} docs/s, "
                      f"{total_bytes / elapsed / 2**20:.2f} MB/s)", file=sys.stderr)
    return {key: tuple(count) for key, count in counts.items()}


def _remove_outputs(builders: dict, prefixes: dict) -> None:
    for key, builder in builders.items():
        builder.data_file.close()
        for suffix in (".bin", ".idx"):
            if os.path.exists(prefixes[key] + suffix):
                os.remove(prefixes[key] + suffix)


if __name__ == "__main__":
    try:
        main()
    except ValueError as err:
        sys.exit(f"preprocess_data.py: error: {err}")
