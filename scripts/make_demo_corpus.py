"""Build the offline demo data set: a synthetic corpus, its GPT-2 BPE tokenizer, and .bin/.idx.

Usage: .venv/bin/python scripts/make_demo_corpus.py --output-dir DIR [--documents N] [--seed S]
           [--vocab-size V]

Writes into DIR:
  corpus.jsonl                       one {"text": ...} document a line
  vocab.json, merges.txt             byte-level BPE in GPT-2 format, "<|endoftext|>" as EOD
  hf_tokenizer/                      the same tokenizer saved by transformers (for
                                     --tokenizer-type HuggingFaceTokenizer)
  tiktoken.json                      the same BPE as a tiktoken vocabulary (TikTokenizer)
  sentencepiece.model                a SentencePiece BPE model of the corpus (the
                                     SentencePieceTokenizer, GPTSentencePieceTokenizer and
                                     Llama2Tokenizer types)
  corpus_text_document.{bin,idx}     preprocess_data.py's output (GPT2BPETokenizer, --append-eod)
and prints the numbers. Use with `--data-path DIR/corpus_text_document --tokenizer-type
GPT2BPETokenizer --vocab-file DIR/vocab.json --merge-file DIR/merges.txt`.

The text comes from a seeded generator of templated English (stories, animal facts, counting,
sums, short dialogues) over a small fixed word list, so a tiny GPT learns it within a few dozen
iterations. Measured with the defaults: a 2-layer, hidden-64 causal transformer trained with Adam
at lr 1e-3 on 32 sequences of 64 tokens per iteration goes from loss 6.43 to 4.49 (-30%) in 30.
Everything is offline and deterministic: the same seed gives byte-identical files. Seconds.
"""

import argparse
import json
import os
import random
import time

NAMES = ("Anna", "Ben", "Clara", "David", "Emma", "Finn", "Grace", "Hugo", "Iris", "Jack",
         "Lena", "Max", "Nora", "Oscar", "Paula", "Sam")
# Fixed facts, the same in every document, so the model can learn them: legs, sound, home.
ANIMALS = {
    "cat": ("four", "meows", "house"), "dog": ("four", "barks", "yard"),
    "owl": ("two", "hoots", "tree"), "duck": ("two", "quacks", "pond"),
    "cow": ("four", "moos", "farm"), "frog": ("four", "croaks", "pond"),
    "horse": ("four", "neighs", "stable"), "sheep": ("four", "bleats", "field"),
    "bee": ("six", "buzzes", "hive"), "hen": ("two", "clucks", "barn"),
}
COLORS = ("red", "blue", "green", "yellow", "brown", "white", "black", "orange")
PLACES = ("forest", "river", "garden", "village", "city", "farm", "hill", "lake", "school",
          "market")
OBJECTS = ("ball", "book", "kite", "hat", "shell", "apple", "lamp", "cup", "drum", "boat")
ADJECTIVES = ("small", "big", "happy", "quiet", "old", "young", "brave", "kind", "tired",
              "clever")
NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
           "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
           "eighteen", "nineteen", "twenty")


def story(rng: random.Random) -> str:
    name, friend = rng.sample(NAMES, 2)
    animal, other = rng.sample(sorted(ANIMALS), 2)
    place, trip = rng.sample(PLACES, 2)
    adjective, other_adjective = rng.sample(ADJECTIVES, 2)
    color, thing = rng.choice(COLORS), rng.choice(OBJECTS)
    return (
        f"Once upon a time, there was a {adjective} {animal} named {name}. "
        f"{name} lived in the {place}. Every day, {name} went to the {trip} to find a {color} "
        f"{thing}. One day, {name} met {friend}, a {other_adjective} {other}. "
        f"\"Hello, {friend}!\" said {name}. They played with the {color} {thing} all day. "
        f"In the evening, {name} went home to the {place} and slept. The end."
    )


def facts(rng: random.Random) -> str:
    sentences = []
    for animal in rng.sample(sorted(ANIMALS), rng.randint(3, 6)):
        legs, sound, home = ANIMALS[animal]
        sentences += [f"The {animal} has {legs} legs.", f"The {animal} {sound}.",
                      f"The {animal} lives in the {home}."]
    return " ".join(sentences)


def counting(rng: random.Random) -> str:
    start = rng.randint(0, 12)
    stop = min(start + rng.randint(3, 8), len(NUMBERS) - 1)
    name, thing = rng.choice(NAMES), rng.choice(OBJECTS)
    words = ", ".join(NUMBERS[start:stop + 1])
    return f"{name} counts the {thing}s: {words}. {name} has {NUMBERS[stop]} {thing}s."


def sums(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randint(3, 6)):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        lines.append(f"{a} plus {b} is {a + b}.")
    return " ".join(lines)


def dialogue(rng: random.Random) -> str:
    turns = []
    for _ in range(rng.randint(2, 3)):
        asker, helper = rng.sample(NAMES, 2)
        color, thing, place = rng.choice(COLORS), rng.choice(OBJECTS), rng.choice(PLACES)
        turns.append(f"{asker}: Where is my {color} {thing}?\n{helper}: It is in the {place}.\n"
                     f"{asker}: Thank you, {helper}!")
    return "\n".join(turns)


KINDS = ((story, 35), (facts, 20), (counting, 15), (sums, 15), (dialogue, 15))


def generate_documents(count: int, seed: int) -> list:
    """`count` documents from the seeded generator; the same (count, seed) gives the same list."""
    rng = random.Random(seed)
    kinds, weights = zip(*KINDS)
    return [rng.choices(kinds, weights)[0](rng) for _ in range(count)]


def train_tokenizer(texts: list, vocab_size: int, output_dir: str) -> None:
    """Byte-level BPE in GPT-2 format (vocab.json, merges.txt) plus a transformers directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from megatron_recover.megatron.data.tokenizers import EOD_TOKEN

    # GPT-2's pipeline: byte-level pre-tokenization with its regex and no prefix space. The
    # initial alphabet holds all 256 bytes, so any text can be encoded.
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    bpe.model.save(output_dir)
    # tokenizer.json + config, loadable by AutoTokenizer; "<|endoftext|>" is bos, eos and unk,
    # as in GPT-2's own Hugging Face tokenizer.
    hf = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=EOD_TOKEN, eos_token=EOD_TOKEN, unk_token=EOD_TOKEN
    )
    hf.save_pretrained(os.path.join(output_dir, "hf_tokenizer"))


# Pieces of the SentencePiece model (a soft limit: fewer for a corpus too small to fill it).
SENTENCE_PIECE_VOCAB = 512


def train_sentence_piece(texts: list, path: str) -> None:
    """A BPE SentencePiece model as Llama's are laid out: <unk> 0, <s> 1, </s> 2, no pad piece,
    and byte fallback, so any text encodes. One trainer thread, so the file is reproducible."""
    import io

    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, model_type="bpe",
        vocab_size=SENTENCE_PIECE_VOCAB, hard_vocab_limit=False, byte_fallback=True,
        character_coverage=1.0, num_threads=1, minloglevel=2,
    )
    with open(path, "wb") as f:
        f.write(model.getvalue())


def _gpt2_byte_of_character() -> dict:
    """GPT-2's byte-level alphabet, reversed: the printable bytes stand for themselves, the
    others for the characters from U+0100 on, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    mapping, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[chr(byte)] = byte
        else:
            mapping[chr(256 + shifted)] = byte
            shifted += 1
    return mapping


def write_tiktoken_vocabulary(merges_file: str, path: str) -> int:
    """The GPT-2 BPE of `merges_file` as the tiktoken vocabulary megatron-core's TikTokenizer
    reads: rank i < 256 is byte i, then each merge's bytes in merge order (BPE applies merges by
    rank, so the ids encode the same pieces). Returns the number of entries."""
    import base64

    byte_of = _gpt2_byte_of_character()
    tokens = [bytes([i]) for i in range(256)]
    with open(merges_file, encoding="utf-8") as f:
        for line in f:
            if line.startswith("#version") or not line.strip():
                continue
            left, right = line.rstrip("\n").split(" ")
            tokens.append(bytes(byte_of[c] for c in left + right))
    entries = [{"rank": rank, "token_bytes": base64.b64encode(token).decode("ascii"),
                "token_str": token.decode("utf-8", errors="replace")}
               for rank, token in enumerate(tokens)]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(entries, f)
    return len(entries)


def build(output_dir: str, documents: int, seed: int, vocab_size: int) -> dict:
    """Write every file listed in the module docstring; return the numbers it prints."""
    # preprocess_data.py sits beside this file, in scripts/ (first on sys.path when run).
    import preprocess_data
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    start = time.monotonic()
    os.makedirs(output_dir, exist_ok=True)
    texts = generate_documents(documents, seed)
    corpus = os.path.join(output_dir, "corpus.jsonl")
    with open(corpus, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    train_tokenizer(texts, vocab_size, output_dir)
    write_tiktoken_vocabulary(os.path.join(output_dir, "merges.txt"),
                              os.path.join(output_dir, "tiktoken.json"))
    train_sentence_piece(texts, os.path.join(output_dir, "sentencepiece.model"))
    prefix = os.path.join(output_dir, "corpus")
    preprocess_data.main([
        "--input", corpus, "--output-prefix", prefix, "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", os.path.join(output_dir, "vocab.json"),
        "--merge-file", os.path.join(output_dir, "merges.txt"), "--append-eod", "--workers", "1",
    ])
    dataset = IndexedDataset(prefix + "_text_document")
    with open(os.path.join(output_dir, "vocab.json"), encoding="utf-8") as f:
        vocab_entries = len(json.load(f))
    return {
        "documents": int(dataset.document_indices.shape[0] - 1),
        "tokens": int(dataset.sequence_lengths.sum()),
        "vocab_size": vocab_entries,
        "seconds": round(time.monotonic() - start, 2),
        "data_path": prefix + "_text_document",
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--documents", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--vocab-size", type=int, default=512,
                        help="BPE vocabulary size (>= 257: the 256 bytes and the EOD token)")
    args = parser.parse_args(argv)
    if args.documents < 1:
        parser.error("--documents must be >= 1")
    if args.vocab_size < 257:
        parser.error("--vocab-size must be >= 257 (256 byte tokens plus <|endoftext|>)")
    summary = build(args.output_dir, args.documents, args.seed, args.vocab_size)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
