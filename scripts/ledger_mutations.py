"""Mutation checks: break layer 2 or the data path on purpose and show the ledger invariant fail.

Usage: .venv/bin/python scripts/ledger_mutations.py [--out DIR]   (about a minute and a half)

Each mutation is a one-line change to a copy of the package, run as a small --recover job (3 or 7
one-rank replicas, 4 iterations, mock data) under mpirun --with-ft ulfm. The check passes when
the run's own log has an iteration with `invariant_ok: false`; the script prints its problems.
Nothing compares losses here: the ledger alone must catch every mutation.
"""

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_recover.launch import LaunchConfig, launch  # noqa: E402

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--eval-iters", "0",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
         "--train-iters", "4", "--mock-data", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "128", "--ddp-bucket-size", "2000", "--log-interval", "1",
         "--lr", "3e-3"]
BOUNDARY = "  - {iteration: 2, replica: 1, local_rank: 0, location: during-reduce}\n"
SPARE_THEN_BLOCKING = ("  - {iteration: 1, replica: 0, local_rank: 0, location: during-reduce}\n"
                       "  - {iteration: 2, replica: 2, local_rank: 0, location: during-reduce}\n"
                       "  - {iteration: 2, replica: 5, local_rank: 0, "
                       "location: during-extension}\n")
ROUND = "megatron_recover/recovery/round.py"
DATA = "megatron_recover/megatron/data/datasets.py"
GPT = "megatron_recover/megatron/adapters/gpt.py"
# PP=2 with 2 virtual stages per rank: an extension pass of 1 microbatch is padded to 2.
INTERLEAVED = ("--num-layers", "4", "--pipeline-model-parallel-size", "2",
               "--num-virtual-stages-per-pipeline-rank", "2")
PADDED = "  - {iteration: 2, replica: 2, local_rank: 0, location: during-reduce}\n"
GRADIENTS = "megatron_recover/recovery/gradients.py"
SNAPSHOT = ("        bucket.snapshot.copy_(grad)\n"
            "        bucket.snapshot_ledger = bucket.ledger.copy()\n")
POST = ("        if not self.mode.contributing or self.nonfinite:\n"
        "            grad.zero_()\n"
        "            bucket.ledger.clear()\n"
        "        bucket.sent = bucket.ledger.copy()\n"
        "        # From here on `grad` holds the replica's (then the replicas') sum, not this rank's "
        "own.\n"
        "        bucket.ledger = Ledger(known=False)\n"
        "        self._post(bucket)\n")


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository
    old: str
    new: str
    replicas: int
    global_batch_size: int
    schedule: str | None  # failure schedule entries, or None: failure-free
    extra: tuple[str, ...] = ()  # further job arguments


REWIND = "            self.recovery.rewind_under_pass()\n"
SYNCED_ONLY = "            if not bucket.synced:\n                continue\n"
MUTATIONS = [
    Mutation("blocking restore zeroes a spare's extension ids (the old contributing line)",
             ROUND, "contributing = (work.contributes_first_pass or self.extended) and not held",
             "contributing = work.contributes_first_pass and not held", 7, 7,
             SPARE_THEN_BLOCKING),
    Mutation("rewind before the extension pass skipped", ROUND, REWIND,
             "            self.recovery.zero()\n", 3, 6, BOUNDARY),
    Mutation("snapshots added on top of the rewind", GRADIENTS, SYNCED_ONLY,
             "            if False:\n                continue\n", 3, 6, BOUNDARY),
    Mutation("_share drops one id", ROUND,
             "mine = ids[shard::shards]",
             "mine = ids[shard::shards][1:]", 3, 6, None),
    Mutation("rank 1 fed the wrong sample for iteration 2, id 2", DATA,
             "samples = [self.dataset[index] for index in self.sample_range(iteration, "
             "microbatch_id)]",
             "samples = [self.dataset[index + (os.environ.get('OMPI_COMM_WORLD_RANK') == '1' "
             "and (iteration, microbatch_id) == (2, 2))] for index in "
             "self.sample_range(iteration, microbatch_id)]", 3, 6, None),
    Mutation("snapshot taken after the bucket is posted (overlapped reductions)", GRADIENTS,
             SNAPSHOT + POST, POST + SNAPSHOT, 3, 6, BOUNDARY, ("--overlap-grad-reduce",)),
    Mutation("a padding microbatch of the interleaved schedule keeps its loss mask", GPT,
             '"loss_mask": torch.zeros_like(batch["loss_mask"])', '"loss_mask": batch["loss_mask"]',
             6, 6, PADDED, INTERLEAVED),
]


def mutated_tree(mutation: Mutation, where: Path) -> Path:
    """A copy of the package and the entry point with `mutation` applied (exactly once)."""
    tree = where / "tree"
    shutil.copytree(ROOT / "megatron_recover", tree / "megatron_recover",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pretrain_gpt_recover.py", tree)
    target = tree / mutation.path
    text = target.read_text()
    if text.count(mutation.old) != 1:
        raise RuntimeError(f"{mutation.name}: the line to mutate is not in {mutation.path} once")
    target.write_text(text.replace(mutation.old, mutation.new))
    return tree


def run(mutation: Mutation, where: Path) -> dict:
    """Run the mutated job; return what its log says about the ledger invariant."""
    tree = mutated_tree(mutation, where)
    log = where / "log.jsonl"
    args = [*MODEL, *mutation.extra, "--global-batch-size", str(mutation.global_batch_size),
            "--recover", "--recover-log", str(log)]
    if mutation.schedule:
        (where / "schedule.yaml").write_text("entries:\n" + mutation.schedule)
        args += ["--recover-failure-schedule", str(where / "schedule.yaml")]
    # The copied entry point imports the mutated package: its own directory comes first.
    result = launch(LaunchConfig(mutation.replicas,
                                 [sys.executable, str(tree / "pretrain_gpt_recover.py"), *args],
                                 where / "status", timeout_s=300))
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    bad = [r for r in records if not r["invariant_ok"]]
    return {"mutation": mutation.name, "timed_out": result.timed_out, "iterations": len(records),
            "caught": bool(bad),
            "first_violation": None if not bad else {
                "iteration": bad[0]["iteration"], "contributions": bad[0]["contributions"],
                "problems": bad[0]["ledger_problems"]}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="keep the runs here (default: a temp dir)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="ledger-mutations-"))
    missed = 0
    for index, mutation in enumerate(MUTATIONS):
        outcome = run(mutation, out / f"m{index}")
        missed += not outcome["caught"]
        violation = outcome["first_violation"]
        print(f"{'CAUGHT' if outcome['caught'] else 'MISSED'}  {mutation.name}", flush=True)
        if violation:
            print(f"        iteration {violation['iteration']}: contributions "
                  f"{violation['contributions']}; " + "; ".join(violation["problems"]))
    print(f"{len(MUTATIONS) - missed}/{len(MUTATIONS)} mutations caught by the ledger invariant")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
