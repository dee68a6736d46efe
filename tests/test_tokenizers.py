"""Every --tokenizer-type megatron-recover accepts, on small tokenizer files built offline
(scripts/make_demo_corpus.py writes the GPT-2 BPE files, their Hugging Face directory and
tiktoken vocabulary, and a SentencePiece model; nothing is downloaded):

- each type's ids, end-of-document id and vocabulary against its library called directly
  (sentencepiece, tiktoken, transformers), and against Megatron-LM core_v0.19.0's tokenizer for
  the same flags (megatron.training's tokenizer flags handed to megatron-core's build_tokenizer,
  as its training and preprocessing do), the model's vocabulary included: the tokenizer's
  vocab_size for every type;
- bad tokenizer input refused, saying what to change; datasets made with another vocabulary
  refused at start-up, one corpus of a blend included;
- the data arguments of Megatron-LM's Mixtral example (Llama2Tokenizer, --mock-data,
  --split 99990,8,2) accepted with a SentencePiece model, and its microbatches built;
- end to end, for each type: scripts/preprocess_data.py writes the demo corpus and one
  --recover iteration trains on it, with the embedding sized from the model vocabulary.

Run: `make test` (the e2e runs are one CPU rank each, under a hard timeout; GPT2BPETokenizer's
and GPTSentencePieceTokenizer's run in `make test-long`).
"""

import argparse
import base64
import json
import subprocess
import sys
from pathlib import Path

import numpy
import pytest

from megatron_recover.megatron.config.arguments import parse_args
from megatron_recover.megatron.data.datasets import MicrobatchSourceConfig
from megatron_recover.megatron.config.mcore_config import padded_vocab_size
from megatron_recover.megatron.data.tokenizers import build_tokenizer
from tests.training_harness import run_training

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import make_demo_corpus  # noqa: E402  (scripts/ is not a package)
import preprocess_data  # noqa: E402

DOCUMENTS = 300
SENTENCE_PIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
TEXTS = ["Once upon a time, there was a small owl named Finn.",
         "Ünïcode 日本 and </s> typed as text.", ""]
# The tiktoken options the demo vocabulary needs: its 511 entries after 16 special ids.
TIKTOKEN_SPECIALS = 16


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizers")
    make_demo_corpus.build(str(directory), DOCUMENTS, 5, 512)
    return directory


def tiktoken_options(demo):
    entries = len(json.loads((demo / "tiktoken.json").read_text()))
    return dict(tokenizer_model=str(demo / "tiktoken.json"), tiktoken_pattern="v2",
                vocab_size=TIKTOKEN_SPECIALS + entries,
                tiktoken_num_special_tokens=TIKTOKEN_SPECIALS)


def sentence_piece(demo):
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(model_file=str(demo / "sentencepiece.model"))


def hugging_face_with_bos(demo) -> Path:
    """The demo's Hugging Face tokenizer with a post-processor that prepends BOS, as Llama's."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    directory = demo / "hf_bos"
    if not directory.exists():
        tokenizer = Tokenizer.from_file(str(demo / "hf_tokenizer" / "tokenizer.json"))
        bos = "<|endoftext|>"
        tokenizer.post_processor = TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tokenizer.token_to_id(bos))])
        PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=bos,
                                eos_token=bos).save_pretrained(str(directory))
    return directory


def megatron_lm(argv):
    """(tokenizer, args) of Megatron-LM core_v0.19.0 for these tokenizer flags: its parser's
    tokenizer group (what its tools/preprocess_data.py reads) and megatron-core's
    build_tokenizer, which its training and its preprocessing call."""
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer as build
    from megatron.training.arguments import _add_tokenizer_args

    args = _add_tokenizer_args(argparse.ArgumentParser()).parse_args(argv)
    args.rank, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size = 0, 128, 1
    return build(args), args


# ----------------------------------------------------------------------------- each type


@pytest.mark.parametrize("kind", SENTENCE_PIECE_TYPES)
def test_sentence_piece_types_encode_as_the_model_does(demo, kind):
    model = sentence_piece(demo)
    tokenizer = build_tokenizer(kind, tokenizer_model=str(demo / "sentencepiece.model"))
    for text in TEXTS:
        # No BOS, for Llama2Tokenizer too: megatron-core's class, as Megatron-LM preprocesses.
        assert tokenizer.tokenize(text) == model.encode(text), text
    assert tokenizer.eod == model.eos_id() == 2
    assert tokenizer.vocab_size == model.get_piece_size()


def test_hugging_face_ids_keep_the_special_tokens_the_tokenizer_adds(demo):
    from transformers import AutoTokenizer

    directory = hugging_face_with_bos(demo)
    reference = AutoTokenizer.from_pretrained(str(directory))
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(directory))
    bos = reference.bos_token_id
    for text in TEXTS:
        ids = tokenizer.tokenize(text)
        # megatron-core 0.19's include_special_tokens (Megatron-LM's default): the tokenizer's
        # own encoding, BOS first; an empty text is [BOS].
        assert ids == reference(text).input_ids == [bos, *reference.encode(
            text, add_special_tokens=False)], text
    assert tokenizer.eod == reference.eos_token_id


def _megatron_lm_cases(demo) -> dict:
    sp = ["--tokenizer-model", str(demo / "sentencepiece.model")]
    options = tiktoken_options(demo)
    return {
        **{kind: (kind, sp) for kind in SENTENCE_PIECE_TYPES},
        "HuggingFaceTokenizer": ("HuggingFaceTokenizer",
                                 ["--tokenizer-model", str(demo / "hf_tokenizer")]),
        "HuggingFaceTokenizer with BOS": ("HuggingFaceTokenizer",
                                          ["--tokenizer-model", str(hugging_face_with_bos(demo))]),
        "TikTokenizer": ("TikTokenizer", [
            "--tokenizer-model", options["tokenizer_model"], "--tiktoken-pattern", "v1",
            "--vocab-size", str(options["vocab_size"]),
            "--tiktoken-num-special-tokens", str(TIKTOKEN_SPECIALS)]),
        "NullTokenizer": ("NullTokenizer", ["--vocab-size", "300"]),
        "NullTokenizer with ids": ("NullTokenizer", ["--vocab-size", "300",
                                                     "--null-tokenizer-eod-id", "7",
                                                     "--null-tokenizer-pad-id", "8"]),
    }


@pytest.mark.parametrize("case", ["SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                                  "Llama2Tokenizer", "HuggingFaceTokenizer",
                                  "HuggingFaceTokenizer with BOS", "TikTokenizer",
                                  "NullTokenizer", "NullTokenizer with ids"])
def test_each_type_is_megatron_lms(demo, case):
    from megatron_recover.megatron.app import run

    kind, flags = _megatron_lm_cases(demo)[case]
    theirs, args = megatron_lm(["--tokenizer-type", kind, *flags])
    cfg = parse_args([*MODEL, "--mock-data", "--tokenizer-type", kind, *flags],
                     world_size=1, cuda_available=False)
    source, vocab_size = run.microbatch_source(cfg)
    ours = source.config.tokenizer
    texts = ["5 6 7", "299 0"] if kind == "NullTokenizer" else TEXTS
    for text in texts:
        assert ours.tokenize(text) == theirs.tokenize(text), text
    assert (ours.eod, ours.pad, ours.vocab_size) == (theirs.eod, theirs.pad, theirs.vocab_size)
    # The model's vocabulary: the tokenizer's, padded as Megatron-LM pads it.
    assert vocab_size == theirs.vocab_size
    assert padded_vocab_size(cfg, vocab_size) == args.padded_vocab_size
    # The same keyword arguments, so the same identity (for the same absolute paths).
    assert ours.unique_identifiers == theirs.unique_identifiers


def _tiktoken_reference(demo, pattern_name: str):
    import tiktoken
    from megatron.core.tokenizers.text.libraries import tiktoken_tokenizer as core

    entries = json.loads((demo / "tiktoken.json").read_text())
    ranks = {base64.b64decode(e["token_bytes"]): e["rank"] + TIKTOKEN_SPECIALS for e in entries}
    specials = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]
    specials += [f"<SPECIAL_{i}>" for i in range(len(specials), TIKTOKEN_SPECIALS)]
    pattern = {"v1": core._PATTERN_TIKTOKEN_V1, "v2": core._PATTERN_TIKTOKEN_V2}[pattern_name]
    return tiktoken.Encoding(name="reference", pat_str=pattern, mergeable_ranks=ranks,
                             special_tokens={t: i for i, t in enumerate(specials)})


def test_tiktoken_ids_are_the_vocabulary_shifted_past_the_special_tokens(demo):
    options = tiktoken_options(demo)
    tokenizer = build_tokenizer("TikTokenizer", **options)
    reference = _tiktoken_reference(demo, "v2")
    for text in TEXTS:
        assert tokenizer.tokenize(text) == reference.encode(text, allowed_special="all"), text
    assert tokenizer.eod == 2  # </s>
    assert tokenizer.vocab_size == options["vocab_size"]
    assert tokenizer.detokenize(tokenizer.tokenize(TEXTS[0])) == TEXTS[0]
    # The demo BPE gives the same pieces as GPT-2 BPE over the same merges.
    gpt2 = build_tokenizer("GPT2BPETokenizer", vocab_file=str(demo / "vocab.json"),
                           merge_file=str(demo / "merges.txt"))
    pieces = [tokenizer.detokenize([i]) for i in tokenizer.tokenize(TEXTS[0])]
    assert pieces == [gpt2.detokenize([i]) for i in gpt2.tokenize(TEXTS[0])]


def test_tiktoken_pattern_selects_the_split(tmp_path):
    # 256 bytes and one merge, "oW", that only the v1 pattern lets meet in "helloWorld" (v2
    # splits words at a lower-to-upper case change).
    tokens = [bytes([i]) for i in range(256)] + [b"oW"]
    vocabulary = tmp_path / "v.json"
    vocabulary.write_text(json.dumps([
        {"rank": r, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode("latin-1")}
        for r, t in enumerate(tokens)]))
    ids = {}
    for pattern in ("v1", "v2", None):  # None: no --tiktoken-pattern, v2 as in Megatron-LM 0.19
        tokenizer = build_tokenizer("TikTokenizer", tokenizer_model=str(vocabulary),
                                    tiktoken_pattern=pattern, vocab_size=257 + 8,
                                    tiktoken_num_special_tokens=8)
        ids[pattern] = tokenizer.tokenize("helloWorld")
    merged = 256 + 8
    assert merged in ids["v1"] and merged not in ids["v2"], ids
    assert ids[None] == ids["v2"]


# ----------------------------------------------------------------------------- bad input


def test_bad_tokenizer_files_are_refused(demo, tmp_path):
    with pytest.raises(ValueError, match="is not a SentencePiece model"):
        build_tokenizer("Llama2Tokenizer", tokenizer_model=str(demo / "tiktoken.json"))
    import sentencepiece

    no_eos = tmp_path / "no_eos.model"
    with open(no_eos, "wb") as f:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(make_demo_corpus.generate_documents(50, 1)), model_writer=f,
            vocab_size=100, hard_vocab_limit=False, eos_id=-1, minloglevel=2)
    with pytest.raises(ValueError, match="has no eos piece"):
        build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=str(no_eos))
    options = tiktoken_options(demo)
    with pytest.raises(ValueError, match="must be the vocabulary's .json"):
        build_tokenizer("TikTokenizer", **{**options,
                                           "tokenizer_model": str(demo / "sentencepiece.model")})
    with pytest.raises(ValueError, match="choose v1 or v2"):
        build_tokenizer("TikTokenizer", **{**options, "tiktoken_pattern": "v3"})
    with pytest.raises(ValueError, match="include <unk> <s> </s> <mask>"):
        build_tokenizer("TikTokenizer", **options,
                        tokenizer_special_tokens=["<unk>", "<s>", "</s>"])
    with pytest.raises(ValueError, match="id2token"):  # the file is shorter than the vocabulary
        build_tokenizer("TikTokenizer", **{**options, "vocab_size": options["vocab_size"] + 1})


MODEL = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
         "--global-batch-size", "2", "--train-iters", "1", "--lr", "1e-3", "--eval-iters", "0",
         "--log-interval", "1"]


def startup_problems(argv) -> list[str]:
    with pytest.raises(ValueError) as info:
        parse_args([*MODEL, *argv], world_size=1, cuda_available=False)
    return str(info.value).splitlines()[1:]


def test_tokenizer_flags_are_checked_at_start_up(demo):
    model = ["--tokenizer-model", str(demo / "sentencepiece.model")]
    tiktoken = ["--tokenizer-type", "TikTokenizer", "--tokenizer-model",
                str(demo / "tiktoken.json"), "--mock-data"]
    cases = [
        ([*tiktoken, "--tiktoken-pattern", "v3"], "--tiktoken-pattern must be v1 or v2"),
        ([*tiktoken, "--tiktoken-pattern", "v2", "--tiktoken-num-special-tokens", "-1"],
         "--tiktoken-num-special-tokens must be >= 0"),
        (["--tokenizer-type", "Llama2Tokenizer", *model, "--mock-data", "--vocab-size", "9"],
         "--vocab-size: --tokenizer-type Llama2Tokenizer takes its vocabulary from its files"),
        (["--tokenizer-type", "Llama2Tokenizer", *model, "--mock-data",
          "--tokenizer-special-tokens", "<s>"], "only TikTokenizer takes a special-token list"),
        (["--tokenizer-type", "BertWordPieceCase", "--vocab-file", "v", "--mock-data"],
         "--tokenizer-type BertWordPieceCase is not supported"),
    ]
    for argv, message in cases:
        problems = startup_problems(argv)
        assert len(problems) == 1 and message in problems[0], (argv, problems)


def test_tiktoken_flags_without_tiktoken_are_named_at_start_up(demo):
    cfg = parse_args([*MODEL, "--mock-data", "--tokenizer-type", "NullTokenizer",
                      "--vocab-size", "64", "--tiktoken-pattern", "v2"],
                     world_size=1, cuda_available=False)
    assert ("megatron-recover: --tiktoken-pattern has no effect with --tokenizer-type "
            "NullTokenizer (only TikTokenizer reads it, as in Megatron-LM)") in cfg.notices
    assert cfg.data.tiktoken_pattern is None
    cfg = parse_args([*MODEL, "--mock-data", "--tokenizer-type", "TikTokenizer",
                      "--tokenizer-model", str(demo / "tiktoken.json"), "--tiktoken-pattern",
                      "v1", "--tokenizer-special-tokens", "<unk>", "<s>", "</s>"],
                     world_size=1, cuda_available=False)
    assert cfg.data.tokenizer_special_tokens == ("<unk>", "<s>", "</s>")


def test_null_tokenizer_flags(demo):
    cfg = parse_args([*MODEL, "--mock-data", "--vocab-size", "64", "--null-tokenizer-eod-id",
                      "5", "--null-tokenizer-pad-id", "6"], world_size=1, cuda_available=False)
    assert (cfg.data.null_tokenizer_eod_id, cfg.data.null_tokenizer_pad_id) == (5, 6)
    problems = startup_problems(["--mock-data", "--vocab-size", "64",
                                 "--null-tokenizer-eod-id", "64"])
    assert [line.strip() for line in problems] == [
        "--null-tokenizer-eod-id 64: must be an id of the vocabulary, 0..63 (--vocab-size 64)"]
    with pytest.raises(ValueError, match="--null-tokenizer-eod-id must be an id of the "
                       "vocabulary, 0..63"):
        build_tokenizer("NullTokenizer", vocab_size=64, null_tokenizer_eod_id=-1)
    # Only NullTokenizer reads them, as in Megatron-LM: named at start-up, not used.
    cfg = parse_args([*MODEL, "--mock-data", "--tokenizer-type", "Llama2Tokenizer",
                      "--tokenizer-model", str(demo / "sentencepiece.model"),
                      "--null-tokenizer-pad-id", "6"], world_size=1, cuda_available=False)
    assert ("megatron-recover: --null-tokenizer-pad-id has no effect with --tokenizer-type "
            "Llama2Tokenizer (only NullTokenizer reads it, as in Megatron-LM)") in cfg.notices
    assert cfg.data.null_tokenizer_pad_id is None


def _preprocessed(demo, tmp_path, name, tokenizer_args) -> str:
    preprocess_data.main(["--input", str(demo / "corpus.jsonl"), "--output-prefix",
                          str(tmp_path / name), *tokenizer_args, "--append-eod"])
    return str(tmp_path / f"{name}_text_document")


def _source_config(tokenizer, blend):
    return MicrobatchSourceConfig(tokenizer=tokenizer, sequence_length=32, micro_batch_size=1,
                                  global_batch_size=2, train_iters=1, blend=(blend, None),
                                  split="100,0,0")


def test_datasets_of_another_vocabulary_are_refused(demo, tmp_path):
    sp_args = ["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model",
               str(demo / "sentencepiece.model")]
    sentence_piece_data = _preprocessed(demo, tmp_path, "sp", sp_args)
    gpt2_data = str(demo / "corpus_text_document")
    # SentencePiece ids run up to the model's size; a 300-id tokenizer cannot have made them.
    null = build_tokenizer("NullTokenizer", vocab_size=300)
    largest = int(numpy.fromfile(sentence_piece_data + ".bin", dtype=numpy.uint16).max())
    assert largest >= null.vocab_size
    with pytest.raises(ValueError, match=f"{sentence_piece_data}: token id {largest} among its "
                       f"first .* outside this tokenizer's 300 ids"):
        _source_config(null, (sentence_piece_data,))
    # int32 ids: written for a vocabulary of 65500 or more, one corpus of a blend.
    (tmp_path / "wide.jsonl").write_text('{"text": "1 2 70000"}\n')
    preprocess_data.main(["--input", str(tmp_path / "wide.jsonl"), "--output-prefix",
                          str(tmp_path / "wide"), "--tokenizer-type", "NullTokenizer",
                          "--vocab-size", "70001"])
    wide = str(tmp_path / "wide_text_document")
    gpt2 = build_tokenizer("GPT2BPETokenizer", vocab_file=str(demo / "vocab.json"),
                           merge_file=str(demo / "merges.txt"))
    with pytest.raises(ValueError, match=f"{wide}: its tokens are int32, while Megatron's "
                       "preprocessing writes uint16 for this tokenizer's 512 ids"):
        _source_config(gpt2, (gpt2_data, wide))
    _source_config(gpt2, (gpt2_data, sentence_piece_data))  # the same size: accepted


# ----------------------------------------------------------------------------- Mixtral's data


def test_mixtral_example_data_arguments_are_accepted(demo):
    from megatron_recover.megatron.app import run

    # examples/mixtral/train_mixtral_8x7b_distributed.sh, DATA_ARGS, with the demo model.
    data_args = ["--tokenizer-type", "Llama2Tokenizer",
                 "--tokenizer-model", str(demo / "sentencepiece.model"),
                 "--mock-data", "--split", "99990,8,2"]
    cfg = parse_args([*MODEL, *data_args], world_size=1, cuda_available=False)
    assert (cfg.data.tokenizer_type, cfg.data.mock_data, cfg.data.split) == (
        "Llama2Tokenizer", True, "99990,8,2")
    source, vocab_size = run.microbatch_source(cfg)
    assert vocab_size == sentence_piece(demo).get_piece_size()
    batch = source.microbatch(1, 0)
    assert tuple(batch["tokens"].shape) == (1, 32)
    assert int(batch["tokens"].max()) < vocab_size


# ----------------------------------------------------------------------------- end to end


def _e2e_cases(demo) -> dict:
    sp = ["--tokenizer-model", str(demo / "sentencepiece.model")]
    options = tiktoken_options(demo)
    return {
        "GPT2BPETokenizer": ["--vocab-file", str(demo / "vocab.json"),
                             "--merge-file", str(demo / "merges.txt")],
        "HuggingFaceTokenizer": ["--tokenizer-model", str(demo / "hf_tokenizer")],
        **{kind: sp for kind in SENTENCE_PIECE_TYPES},
        "TikTokenizer": ["--tokenizer-model", options["tokenizer_model"],
                         "--tiktoken-pattern", "v2", "--vocab-size", str(options["vocab_size"]),
                         "--tiktoken-num-special-tokens", str(TIKTOKEN_SPECIALS)],
        "NullTokenizer": ["--vocab-size", "300"],
    }


@pytest.mark.mpi
@pytest.mark.e2e
@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", [
    # make test's budget: the Hugging Face one; the others in make test-long (Llama 2 and
    # tiktoken moved there when mixture-of-experts came in). GPT-2 BPE is trained by every blend
    # test too, GPTSentencePieceTokenizer is Llama2Tokenizer's class and SentencePieceTokenizer
    # reads the same model (the unit tests check all three), and every other end-to-end run
    # trains NullTokenizer on mock data.
    pytest.param("GPT2BPETokenizer", marks=pytest.mark.long), "HuggingFaceTokenizer",
    pytest.param("SentencePieceTokenizer", marks=pytest.mark.long),
    pytest.param("GPTSentencePieceTokenizer", marks=pytest.mark.long),
    pytest.param("Llama2Tokenizer", marks=pytest.mark.long),
    pytest.param("TikTokenizer", marks=pytest.mark.long),
    pytest.param("NullTokenizer", marks=pytest.mark.long)])
def test_each_tokenizer_preprocesses_and_trains(demo, tmp_path, kind):
    tokenizer_args = ["--tokenizer-type", kind, *_e2e_cases(demo)[kind]]
    corpus = demo / "corpus.jsonl"
    if kind == "NullTokenizer":  # its text is ids: the GPT-2 ids of the demo documents
        gpt2 = build_tokenizer("GPT2BPETokenizer", vocab_file=str(demo / "vocab.json"),
                               merge_file=str(demo / "merges.txt"))
        corpus = tmp_path / "ids.jsonl"
        corpus.write_text("".join(
            json.dumps({"text": " ".join(str(i % 300) for i in gpt2.tokenize(text))}) + "\n"
            for text in make_demo_corpus.generate_documents(DOCUMENTS, 5)))
    subprocess.run([sys.executable, str(ROOT / "scripts/preprocess_data.py"), "--input",
                    str(corpus), "--output-prefix", str(tmp_path / "data"), *tokenizer_args,
                    "--append-eod"], check=True, capture_output=True, timeout=120)
    run = run_training(tmp_path / "run", 1, [
        *MODEL, *tokenizer_args, "--data-path", str(tmp_path / "data_text_document"),
        "--split", "100,0,0"], timeout_s=150)
    assert [r["iteration"] for r in run.records] == [1]
    # The model's vocabulary, the tokenizer's (from its own files), padded to a multiple of 128.
    expected = {"GPT2BPETokenizer": 512, "HuggingFaceTokenizer": 512, "NullTokenizer": 300,
                "TikTokenizer": tiktoken_options(demo)["vocab_size"]}.get(
                    kind, sentence_piece(demo).get_piece_size())
    padded = -(-expected // 128) * 128
    assert (f" > padded vocab (size: {expected}) with {padded - expected} dummy tokens "
            f"(new size: {padded})") in run.result.output
    embedding = run.params(0)["embedding.word_embeddings.weight"]
    assert embedding.shape[0] == padded
