"""The data pipeline: tokenizers, preprocess_data.py, the demo corpus, and MicrobatchSource.

Run:  .venv/bin/python -m pytest tests/test_data.py -q -p no:cacheprovider
Hardware: CPU only, offline. About 10 s, most of it importing megatron-core and one subprocess
run of scripts/make_demo_corpus.py.

What is checked:
- preprocess_data.py writes megatron-core's .bin/.idx so that `IndexedDataset` reads back exactly
  the tokenizer's ids plus EOD, one document per line (empty and sentence-list documents as
  Megatron-LM stores them), with each tokenizer type; 1 and 2 workers write identical bytes.
- The demo builder is deterministic for a seed and its GPT-2 files work with both the
  GPT2BPETokenizer and HuggingFaceTokenizer paths.
- MicrobatchSource: the id -> sample mapping of docs/design.md, "Exact semantics" (main stream
  partitions the training samples; reserve ids come after it), bitwise-equal microbatches across
  independent builds, a cache hit, and concurrent builders; Megatron's batch layout; mock data.
- Bad input stops with a ValueError (RuntimeError for building after torch.distributed is up).
"""

import json
import multiprocessing
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
import torch

from megatron_recover.megatron.data.audit import DatasetAudit
from megatron_recover.megatron.data.datasets import LOCK_NAME, MicrobatchSource, MicrobatchSourceConfig
from megatron_recover.megatron.data.tokenizers import build_tokenizer
from tests.policy.test_rampup import megatron_batches

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = REPO_ROOT / "scripts"
sys.path.insert(0, str(SCRIPTS))

import make_demo_corpus  # noqa: E402  (scripts/ is not a package)
import preprocess_data  # noqa: E402

DEMO_DOCUMENTS = 600
DEMO_SEED = 7
DEMO_VOCAB = 384
SEQ = 32
MBS = 2
GBS = 8
TRAIN_ITERS = 5


def indexed(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return IndexedDataset(str(prefix))


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def gpt2_args(demo):
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(demo / "vocab.json"),
            "--merge-file", str(demo / "merges.txt")]


def preprocess(jsonl, prefix, tokenizer_args, *extra):
    return preprocess_data.main(["--input", str(jsonl), "--output-prefix", str(prefix),
                                 *tokenizer_args, *extra])


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    directory = tmp_path_factory.mktemp("demo")
    make_demo_corpus.build(str(directory), DEMO_DOCUMENTS, DEMO_SEED, DEMO_VOCAB)
    return directory


@pytest.fixture(scope="module")
def gpt2(demo):
    return build_tokenizer("GPT2BPETokenizer", vocab_file=str(demo / "vocab.json"),
                           merge_file=str(demo / "merges.txt"))


def source_config(demo, gpt2, **overrides):
    settings = dict(tokenizer=gpt2, sequence_length=SEQ, micro_batch_size=MBS,
                    global_batch_size=GBS, train_iters=TRAIN_ITERS,
                    blend=((str(demo / "corpus_text_document"),), None), split="90,10,0",
                    cache_dir=str(demo / "cache"))
    settings.update(overrides)
    return MicrobatchSourceConfig(**settings)


# ----------------------------------------------------------------------------- preprocessing


DOCUMENTS = [
    {"text": "Once upon a time, there was a small owl named Finn."},
    {"text": ""},  # no ids: kept as a document without sequences, as Megatron-LM does
    {"text": ["The cat meows.", "", "The dog barks."]},  # sentence-split input
    {"text": "Ünïcode 日本 and <|endoftext|> typed as text."},
]


def test_gpt2bpe_round_trip_through_indexed_dataset(demo, gpt2, tmp_path):
    jsonl = write_jsonl(tmp_path / "docs.jsonl", DOCUMENTS)
    counts = preprocess(jsonl, tmp_path / "one", gpt2_args(demo), "--append-eod", "--workers", "1")
    preprocess(jsonl, tmp_path / "two", gpt2_args(demo), "--append-eod", "--workers", "2")

    data = indexed(tmp_path / "one_text_document")
    assert data.index.dtype == numpy.uint16
    assert list(data.document_indices) == [0, 1, 1, 3, 4]
    first, cat, dog, unicode = (list(data[i]) for i in range(len(data)))
    assert first == gpt2.tokenize(DOCUMENTS[0]["text"]) + [gpt2.eod]
    assert cat == gpt2.tokenize("The cat meows.")
    assert dog == gpt2.tokenize("The dog barks.") + [gpt2.eod]
    assert unicode == gpt2.tokenize(DOCUMENTS[3]["text"]) + [gpt2.eod]
    assert gpt2.eod not in unicode[:-1]  # GPT-2 BPE does not parse special tokens in text
    assert gpt2.detokenize(unicode[:-1]) == DOCUMENTS[3]["text"]
    assert counts == {"text": (4, len(first) + len(cat) + len(dog) + len(unicode))}
    for suffix in (".bin", ".idx"):
        one = (tmp_path / f"one_text_document{suffix}").read_bytes()
        assert one == (tmp_path / f"two_text_document{suffix}").read_bytes()


def test_without_append_eod_and_with_several_json_keys(demo, gpt2, tmp_path):
    jsonl = write_jsonl(tmp_path / "docs.jsonl", [{"text": "The hen clucks.", "title": "Hen"}])
    preprocess(jsonl, tmp_path / "out", gpt2_args(demo), "--json-keys", "text", "title")
    # Keep each IndexedDataset alive while reading: its arrays are views of its memory map.
    text, title = indexed(tmp_path / "out_text_document"), indexed(tmp_path / "out_title_document")
    assert list(text[0]) == gpt2.tokenize("The hen clucks.")
    assert list(title[0]) == gpt2.tokenize("Hen")


def test_null_tokenizer_round_trip(tmp_path):
    jsonl = write_jsonl(tmp_path / "ids.jsonl", [{"text": "5 6 7"}, {"text": "0 99"}])
    preprocess(jsonl, tmp_path / "null", ["--tokenizer-type", "NullTokenizer",
                                          "--vocab-size", "100"], "--append-eod")
    data = indexed(tmp_path / "null_text_document")
    # megatron-core 0.19: the vocabulary is --vocab-size ids, its last one EOD.
    assert [list(data[0]), list(data[1])] == [[5, 6, 7, 99], [0, 99, 99]]
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=100)
    assert (tokenizer.eod, tokenizer.vocab_size) == (99, 100)
    preprocess(jsonl, tmp_path / "eod", ["--tokenizer-type", "NullTokenizer", "--vocab-size",
                                         "100", "--null-tokenizer-eod-id", "0"], "--append-eod")
    data = indexed(tmp_path / "eod_text_document")
    assert [list(data[0]), list(data[1])] == [[5, 6, 7, 0], [0, 99, 0]]


def test_hugging_face_tokenizer_matches_gpt2_files(demo, gpt2, tmp_path):
    hf_args = ["--tokenizer-type", "HuggingFaceTokenizer",
               "--tokenizer-model", str(demo / "hf_tokenizer")]
    preprocess(demo / "corpus.jsonl", tmp_path / "hf", hf_args, "--append-eod", "--workers", "2")
    ours = indexed(tmp_path / "hf_text_document")
    reference = indexed(demo / "corpus_text_document")
    assert len(ours) == len(reference) == DEMO_DOCUMENTS
    for i in range(0, DEMO_DOCUMENTS, 37):
        assert numpy.array_equal(ours[i], reference[i])
    hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(demo / "hf_tokenizer"))
    assert (hf.eod, hf.vocab_size) == (gpt2.eod, gpt2.vocab_size)


@pytest.mark.parametrize("line, message", [
    ('{"text": "fine"}\n{"txt": "no text key"}\n', "line 2: no 'text' key"),
    ('{"text": "fine"}\n{"text": \n', "line 2: invalid JSON"),
    ('{"text": 5}\n', "line 1: 'text' must be a string"),
    ('["not", "an object"]\n', "line 1: a line must hold a JSON object"),
])
def test_bad_lines_stop_and_leave_no_output(demo, tmp_path, line, message):
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text(line, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        preprocess(jsonl, tmp_path / "bad", gpt2_args(demo), "--workers", "2")
    assert not list(tmp_path.glob("bad_text_document*"))


def test_null_ids_outside_the_vocabulary_are_refused(tmp_path):
    jsonl = write_jsonl(tmp_path / "ids.jsonl", [{"text": "1 2"}, {"text": "3 101"}])
    with pytest.raises(ValueError, match=r"line 2: token id out of range \[0, 100\)"):
        preprocess(jsonl, tmp_path / "null", ["--tokenizer-type", "NullTokenizer",
                                              "--vocab-size", "100"])


def test_missing_input_is_refused(demo, tmp_path):
    with pytest.raises(ValueError, match="--input not found"):
        preprocess(tmp_path / "absent.jsonl", tmp_path / "out", gpt2_args(demo))


@pytest.mark.parametrize("kwargs, message", [
    (dict(tokenizer_type="BertWordPieceCase"), "unknown tokenizer type"),
    (dict(tokenizer_type="Llama2Tokenizer"), "needs --tokenizer-model"),
    (dict(tokenizer_type="Llama2Tokenizer", tokenizer_model="m", vocab_size=8),
     "does not use --vocab-size"),
    (dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model="m",
          tokenizer_special_tokens=["<s>"]),
     "does not use --tokenizer-special-tokens"),
    (dict(tokenizer_type="GPT2BPETokenizer", vocab_file="v.json"), "needs --merge-file"),
    (dict(tokenizer_type="GPT2BPETokenizer", vocab_file="absent.json", merge_file="absent.txt"),
     "tokenizer file not found: absent.json"),
    (dict(tokenizer_type="NullTokenizer"), "needs --vocab-size"),
    (dict(tokenizer_type="NullTokenizer", vocab_size=0), "--vocab-size >= 1"),
    (dict(tokenizer_type="NullTokenizer", vocab_size=10, vocab_file="v.json"),
     "does not use --vocab-file"),
    (dict(tokenizer_type="NullTokenizer", vocab_size=10, null_tokenizer_eod_id=10),
     "--null-tokenizer-eod-id must be an id of the vocabulary, 0..9"),
    (dict(tokenizer_type="Llama2Tokenizer", tokenizer_model="m", null_tokenizer_pad_id=0),
     "does not use --null-tokenizer-pad-id"),
    (dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="gpt2"),
     "needs a local --tokenizer-model"),
])
def test_tokenizer_mistakes_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_tokenizer(**kwargs)


def test_gpt2_vocab_without_eod_is_refused(demo, tmp_path):
    vocab = json.loads((demo / "vocab.json").read_text(encoding="utf-8"))
    del vocab["<|endoftext|>"]
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    with pytest.raises(ValueError, match="no '<\\|endoftext\\|>' entry"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"),
                        merge_file=str(demo / "merges.txt"))


# ----------------------------------------------------------------------------- demo corpus


def test_demo_corpus_is_deterministic_for_a_seed(demo, tmp_path):
    make_demo_corpus.build(str(tmp_path / "same"), DEMO_DOCUMENTS, DEMO_SEED, DEMO_VOCAB)
    for name in ("corpus.jsonl", "vocab.json", "merges.txt", "corpus_text_document.bin",
                 "corpus_text_document.idx", "hf_tokenizer/tokenizer.json"):
        assert (tmp_path / "same" / name).read_bytes() == (demo / name).read_bytes(), name
    other = make_demo_corpus.generate_documents(DEMO_DOCUMENTS, DEMO_SEED + 1)
    assert other != make_demo_corpus.generate_documents(DEMO_DOCUMENTS, DEMO_SEED)


def test_demo_corpus_command_line(tmp_path):
    run = subprocess.run(
        [sys.executable, str(SCRIPTS / "make_demo_corpus.py"), "--output-dir", str(tmp_path),
         "--documents", "50", "--seed", "3"],
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["documents"] == 50 and summary["vocab_size"] == 512
    data = indexed(summary["data_path"])
    assert int(data.sequence_lengths.sum()) == summary["tokens"]


# ----------------------------------------------------------------------------- microbatches


@pytest.fixture(scope="module")
def source(demo, gpt2):
    return MicrobatchSource(source_config(demo, gpt2, reserve_microbatches=6))


def test_microbatch_is_megatrons_gpt_batch(source, gpt2):
    batch = source.microbatch(2, 1)
    assert set(batch) == {"tokens", "labels", "loss_mask", "attention_mask", "position_ids",
                          "iteration", "microbatch_id"}
    assert (batch["iteration"], batch["microbatch_id"]) == (2, 1)
    for key in ("tokens", "labels", "position_ids"):
        assert batch[key].dtype == torch.int64 and batch[key].shape == (MBS, SEQ)
    assert batch["loss_mask"].dtype == torch.float32 and bool(torch.all(batch["loss_mask"] == 1))
    assert batch["attention_mask"] is None
    assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
    assert torch.equal(batch["position_ids"], torch.arange(SEQ).expand(MBS, SEQ))
    assert int(batch["tokens"].max()) < gpt2.vocab_size
    rows = [source.dataset[i]["tokens"] for i in source.sample_range(2, 1)]
    assert torch.equal(batch["tokens"], torch.stack(rows))


def test_dense_attention_mask_on_request(demo, gpt2):
    masked = MicrobatchSource(source_config(demo, gpt2, create_attention_mask=True))
    mask = masked.microbatch(1, 0)["attention_mask"]
    assert mask.dtype == torch.bool and mask.shape == (MBS, 1, SEQ, SEQ)
    assert torch.equal(mask[0, 0], torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1))


def test_ids_partition_the_training_samples_and_reserve_comes_after(source):
    config = source.config
    b = config.microbatches_per_iteration
    main = [list(source.sample_range(t, k)) for t in range(1, TRAIN_ITERS + 1) for k in range(b)]
    assert sorted(i for r in main for i in r) == list(range(config.main_samples))
    assert source.sample_range(3, 2) == range(2 * GBS + 2 * MBS, 2 * GBS + 3 * MBS)
    reserve = [list(source.sample_range(1, b + j)) for j in range(config.reserve_microbatches)]
    assert sorted(i for r in reserve for i in r) == list(range(config.main_samples,
                                                                config.num_samples))
    assert source.sample_range(1, b + 2) == source.sample_range(TRAIN_ITERS, b + 2)
    # Distinct positions are distinct samples: megatron's shuffle index is a permutation.
    shuffled = source.dataset.shuffle_index[: config.num_samples]
    assert len(set(shuffled.tolist())) == config.num_samples
    assert len(source.dataset) >= config.num_samples
    ids = [(t, k) for t in (1, 2) for k in range(b)] + [(1, b), (1, b + 1)]
    tokens = {source.microbatch(t, k)["tokens"].numpy().tobytes() for t, k in ids}
    assert len(tokens) == len(ids)


def test_same_config_gives_bitwise_equal_microbatches(demo, gpt2, source, tmp_path):
    independent = MicrobatchSource(source_config(demo, gpt2, reserve_microbatches=6,
                                                 cache_dir=str(tmp_path / "own_cache")))
    cache_hit = MicrobatchSource(source_config(demo, gpt2, reserve_microbatches=6))
    b = source.config.microbatches_per_iteration
    for iteration, microbatch_id in [(1, 0), (2, 3), (TRAIN_ITERS, b - 1), (4, b + 5)]:
        expected = source.microbatch(iteration, microbatch_id)
        for other in (independent, cache_hit):
            got = other.microbatch(iteration, microbatch_id)
            for key in ("tokens", "labels", "loss_mask", "position_ids"):
                assert torch.equal(got[key], expected[key]), (iteration, microbatch_id, key)


def test_no_mmap_bin_files_reads_the_same_samples_without_a_memory_map(demo, gpt2, source):
    unmapped = MicrobatchSource(source_config(demo, gpt2, reserve_microbatches=6,
                                              mmap_bin_files=False))
    # megatron-core's reader for --no-mmap-bin-files reads the file per sample.
    assert type(unmapped.dataset.dataset.bin_reader).__name__ == "_FileBinReader"
    assert type(source.dataset.dataset.bin_reader).__name__ == "_MMapBinReader"
    for iteration, microbatch_id in [(1, 0), (3, 2)]:
        assert torch.equal(unmapped.microbatch(iteration, microbatch_id)["tokens"],
                           source.microbatch(iteration, microbatch_id)["tokens"])


def test_reserve_does_not_change_the_main_stream_when_it_fits(demo, gpt2, source):
    plain = MicrobatchSource(source_config(demo, gpt2))
    assert len(plain.dataset) >= source.config.num_samples  # the epoch slack holds the reserve
    for microbatch_id in range(source.config.microbatches_per_iteration):
        assert torch.equal(plain.microbatch(3, microbatch_id)["tokens"],
                           source.microbatch(3, microbatch_id)["tokens"])


def test_reserve_beyond_the_epoch_slack_sizes_the_split_for_it(demo, gpt2):
    plain = MicrobatchSource(source_config(demo, gpt2))
    slack = (len(plain.dataset) - plain.config.main_samples) // MBS
    big = MicrobatchSource(source_config(demo, gpt2, reserve_microbatches=slack + 50))
    assert len(big.dataset) >= big.config.num_samples
    last = big.config.microbatches_per_iteration + slack + 49
    assert big.microbatch(1, last)["tokens"].shape == (MBS, SEQ)


def _build_and_digest(config):
    batches = MicrobatchSource(config)
    return [batches.microbatch(t, k)["tokens"].sum().item() for t in (1, 3) for k in (0, 3)]


def test_concurrent_builders_share_one_cache(demo, gpt2, tmp_path):
    config = source_config(demo, gpt2, cache_dir=str(tmp_path / "shared"), seed=99)
    # Forked builders start together with an empty cache; the flock makes them take turns.
    with multiprocessing.get_context("fork").Pool(3) as pool:
        digests = pool.map(_build_and_digest, [config] * 3)
    assert digests[0] == digests[1] == digests[2] == _build_and_digest(config)
    assert (tmp_path / "shared" / LOCK_NAME).exists()
    assert len(list((tmp_path / "shared").glob("*-GPTDataset-train-shuffle_index.npy"))) == 1


def test_megatrons_document_flags(demo, gpt2):
    flagged = MicrobatchSource(source_config(demo, gpt2, reset_position_ids=True,
                                             eod_mask_loss=True))
    batches = [flagged.microbatch(t, k) for t in (1, 2) for k in range(GBS // MBS)]
    tokens = torch.cat([batch["tokens"] for batch in batches])
    positions = torch.cat([batch["position_ids"] for batch in batches])
    loss_mask = torch.cat([batch["loss_mask"] for batch in batches])
    eods = [(row, column) for row, column in (tokens == gpt2.eod).nonzero().tolist()
            if column + 1 < SEQ]
    assert eods  # the demo documents are shorter than a few samples
    assert all(positions[row, column + 1] == 0 for row, column in eods)
    assert torch.equal(loss_mask == 0, tokens == gpt2.eod)


def test_mock_data(gpt2):
    config = MicrobatchSourceConfig(tokenizer=gpt2, sequence_length=SEQ, micro_batch_size=MBS,
                                    global_batch_size=GBS, train_iters=TRAIN_ITERS, split=None)
    first, second = MicrobatchSource(config), MicrobatchSource(config)
    batch = first.microbatch(2, 3)
    assert batch["tokens"].shape == (MBS, SEQ) and int(batch["tokens"].max()) < gpt2.vocab_size
    assert torch.equal(batch["tokens"], second.microbatch(2, 3)["tokens"])


SCHEDULE = "0:2 64:4 0.2K:8"  # tokens of SEQ 32: 2 samples from 0, 4 from 2, 8 from 6


def test_schedule_iterations_take_their_own_global_batch(demo, gpt2):
    """With --step-batch-size-schedule "0:2 64:4 0.2K:8" (mbs 2, last step 8) each iteration
    holds the samples megatron-core's calculator gives it (2, 4, then 8), starting where the
    previous one ended; ids beyond an iteration's B are refused, and reserve ids start after the
    main stream."""
    ramped = MicrobatchSource(source_config(demo, gpt2, step_batch_size_schedule=SCHEDULE,
                                            train_iters=6, reserve_microbatches=2))
    batches = megatron_batches(SCHEDULE, SEQ, iterations=6)
    sizes = [size for _, size in batches]
    assert sizes[:3] == [2, 4, 8]
    for t, (start, size) in enumerate(batches, start=1):
        ranges = [ramped.sample_range(t, k) for k in range(size // MBS)]
        assert [i for r in ranges for i in r] == list(range(start, start + size))
        if size < GBS:  # ids B_t..B-1 do not exist before the last step (B and up: reserve)
            with pytest.raises(ValueError, match=f"outside 0..{size // MBS - 1} "):
                ramped.sample_range(t, size // MBS)
    assert ramped.config.main_samples == sum(sizes) == 38
    # The ledger audit's expected side steps megatron-core's calculator itself, tokens and all.
    audit = DatasetAudit(ramped.dataset, global_batch_size=GBS, micro_batch_size=MBS,
                         main_samples=38, policy="static", mode="exact",
                         step_batch_size_schedule=SCHEDULE, seq_length=SEQ)
    assert [audit.global_batch(t) for t in range(1, 7)] == batches
    assert ramped.sample_range(2, GBS // MBS) == range(sum(sizes), sum(sizes) + MBS)
    # Megatron-LM runs the last iteration of a schedule whole past --train-samples: the split is
    # asked for 37 samples, the main stream reads 38, the reserve stream starts after them.
    past = source_config(demo, gpt2, step_batch_size_schedule=SCHEDULE, train_iters=6,
                         train_samples=37)
    assert (past.split_samples, past.main_samples) == (37, 38)
    # Without a schedule the iterations' whole batches lie in the split.
    with pytest.raises(ValueError, match="less than the 40 samples 5 iterations consume"):
        source_config(demo, gpt2, train_iters=5, train_samples=39)
    with pytest.raises(ValueError, match="global_batch_size 16 is not the last step"):
        source_config(demo, gpt2, step_batch_size_schedule=SCHEDULE, global_batch_size=16)


def test_evaluation_reads_its_own_global_batch(demo, gpt2):
    """With a schedule Megatron-LM evaluates eval_iters batches of its default global batch
    size (mbs x dp): eval_global_batch_size, here 4 samples, 2 microbatches an iteration."""
    source = MicrobatchSource(source_config(
        demo, gpt2, step_batch_size_schedule=SCHEDULE, eval_iters=3, evaluations=2,
        eval_global_batch_size=4))
    assert source.eval_microbatches == 3 * 4 // MBS
    second = source.eval_microbatch("valid", 2, 0)
    assert torch.equal(second["tokens"], torch.stack(
        [source.eval_datasets["valid"][i]["tokens"] for i in range(12, 14)]))
    with pytest.raises(ValueError, match="outside 0..5"):
        source.eval_microbatch("valid", 1, 6)


@pytest.mark.parametrize("iteration, microbatch_id, message", [
    (0, 0, "iteration 0 is outside 1..5"),
    (TRAIN_ITERS + 1, 0, "iteration 6 is outside"),
    (1, -1, "microbatch id -1 of iteration 1 is outside"),
    (1, GBS // MBS + 6, "microbatch id 10 of iteration 1 is outside 0..3 .* 4..9"),
])
def test_out_of_range_ids_are_refused(source, iteration, microbatch_id, message):
    with pytest.raises(ValueError, match=message):
        source.microbatch(iteration, microbatch_id)


@pytest.mark.parametrize("overrides, message", [
    (dict(global_batch_size=7), "must be a multiple of micro_batch_size"),
    (dict(micro_batch_size=0), "micro_batch_size must be an integer >= 1"),
    (dict(reserve_microbatches=-1), "reserve_microbatches must be an integer >= 0"),
    (dict(split="0,1,1"), "positive training weight"),
    (dict(blend=(("/nonexistent/corpus_text_document",), None)), "without the suffix"),
    (dict(blend=(("/nonexistent/a", "/nonexistent/b"), (1.0,))), "one non-negative weight each"),
    (dict(tokenizer=object()), "tokenizer has no 'eod'"),
    (dict(split=None), "split must be"),
    (dict(reset_attention_mask=True), "reset_attention_mask needs create_attention_mask"),
])
def test_config_mistakes_are_value_errors(demo, gpt2, overrides, message):
    with pytest.raises(ValueError, match=message):
        source_config(demo, gpt2, **overrides)


def test_building_after_torch_distributed_is_refused(demo, gpt2, tmp_path):
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="before torch.distributed is initialized"):
            MicrobatchSource(source_config(demo, gpt2))
    finally:
        torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------- blends


@pytest.fixture(scope="module")
def corpora(demo, tmp_path_factory):
    """Three corpora with the demo tokenizer: the demo's documents dealt into three files."""
    directory = tmp_path_factory.mktemp("corpora")
    lines = (demo / "corpus.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    prefixes = []
    for k, name in enumerate(("web", "code", "books")):
        jsonl = directory / f"{name}.jsonl"
        jsonl.write_text("".join(lines[k::3]), encoding="utf-8")
        preprocess(jsonl, directory / name, gpt2_args(demo), "--append-eod")
        prefixes.append(str(directory / f"{name}_text_document"))
    return prefixes


def test_a_weighted_blend_is_megatrons_blended_dataset(demo, gpt2, corpora):
    weights = (0.5, 0.3, 0.2)
    source = MicrobatchSource(source_config(demo, gpt2, blend=(tuple(corpora), weights),
                                            cache_dir=None))
    blend = source.dataset
    samples = source.config.main_samples
    chosen = numpy.asarray(blend.dataset_index[:samples])
    # megatron's blending picks, sample after sample, the dataset furthest below its share, so
    # after n samples each dataset holds its weight's share of them to within one sample.
    for k, weight in enumerate(weights):
        assert abs(int((chosen == k).sum()) - weight * samples) <= 1, (k, chosen.tolist())
    assert [blend.datasets[k].dataset.path_prefix for k in range(3)] == corpora
    for iteration, microbatch_id in [(1, 0), (3, 2), (TRAIN_ITERS, 3)]:
        got = source.microbatch(iteration, microbatch_id)["tokens"]
        rows = [blend.datasets[int(blend.dataset_index[i])][int(blend.dataset_sample_index[i])]
                ["tokens"] for i in source.sample_range(iteration, microbatch_id)]
        assert torch.equal(got, torch.stack(rows))
    # Without --data-cache-path each dataset caches beside its own prefix, under its lock.
    for prefix in corpora:
        cache = Path(prefix) / "cache" / "GPTDataset_indices"
        assert (cache / LOCK_NAME).exists() and list(cache.glob("*-GPTDataset-train-*.npy"))
    again = MicrobatchSource(source_config(demo, gpt2, blend=(tuple(corpora), weights),
                                           cache_dir=None))  # from the cache
    assert torch.equal(again.microbatch(2, 1)["tokens"], source.microbatch(2, 1)["tokens"])
    # 200 documents a corpus: 949,50,1 leaves the test split of each empty, which megatron-core
    # would search for ever for a sample's tokens.
    with pytest.raises(ValueError, match="has 200 documents and gets none in the test split"):
        MicrobatchSource(source_config(demo, gpt2, blend=(tuple(corpora), weights),
                                       split="949,50,1"))


def test_per_split_blends_are_used_whole(demo, gpt2, corpora):
    web, code, books = corpora
    source = MicrobatchSource(source_config(
        demo, gpt2, blend=None, split=None, cache_dir=None, eval_iters=1, evaluations=1,
        blend_per_split=(((web, code), (0.6, 0.4)), ((books,), None), None)))
    train = source.dataset
    assert [d.dataset.path_prefix for d in train.datasets] == [web, code]
    # Used whole: each training dataset indexes all of its documents (no --split cut).
    for dataset in train.datasets:
        assert len(dataset.indices) == len(indexed(dataset.dataset.path_prefix))
    valid = source.eval_datasets["valid"]
    assert valid.dataset.path_prefix == books and len(valid.indices) == len(indexed(books))
    assert "test" not in source.eval_datasets
    with pytest.raises(ValueError, match="blend_per_split excludes blend and split"):
        source_config(demo, gpt2, blend_per_split=(((web,), None), None, None))
