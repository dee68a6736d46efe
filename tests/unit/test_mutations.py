"""Break the protocol on purpose, in one process: each mutation must be caught.

Run: .venv/bin/python -m pytest tests/unit/test_mutations.py   (no MPI; seconds)

The layer-2 mutations are those of `scripts/ledger_mutations.py` (the same one-line changes to
the same files), run here on lockstep replicas with the failure schedule of their end-to-end run;
the ledger invariant alone must catch each: some committed iteration's audit fails. (The data-path
mutation, a wrong sample fed on one rank, stays an end-to-end run in test_ledger_mutations.py:
it needs megatron's data pipeline.) A mutation of the commit-lane codec and one of the replica
verdict codec must each make `check_run` fail. Every mutated line must occur exactly once.
"""

import importlib
import sys
import types
from pathlib import Path

import pytest

from megatron_recover.testing.invariants import check_run
from megatron_recover.testing.lockstep import Failure, Setup, run_lockstep

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import ledger_mutations  # noqa: E402

pytestmark = pytest.mark.unit

# The end-to-end schedules of ledger_mutations.py as lockstep failures.
SCHEDULES = {
    ledger_mutations.BOUNDARY: (Failure(1, 2, "during-reduce", 2),),
    ledger_mutations.SPARE_THEN_BLOCKING: (Failure(0, 1, "during-reduce", 2),
                                           Failure(2, 2, "during-reduce", 2),
                                           Failure(5, 2, "during-extension")),
    None: (),
}
# Where the mutated module's classes are looked up by the code under test.
USERS = {
    "megatron_recover/recovery/round.py": [
        (importlib.import_module("megatron_recover.recovery.trainer"), "Round")],
    "megatron_recover/recovery/gradients.py": [
        (importlib.import_module("megatron_recover.recovery.round"), "GradientRecovery")],
    "megatron_recover/recovery/lane.py": [
        (importlib.import_module("megatron_recover.recovery.round"), "CommitLane"),
        (importlib.import_module("megatron_recover.recovery.round"), "VerdictCodec")],
    # The registered checks, looked up where the registry builds them.
    **{f"megatron_recover/recovery/checks/{module}.py": [
        (importlib.import_module("megatron_recover.recovery.checks"), name)]
       for module, name in (("nonfinite", "NonfiniteReruns"), ("sdc", "SampledVerification"),
                            ("ledger_audit", "LedgerAudit"), ("stragglers", "Stragglers"),
                            ("side_sums", "SideSums"))},
}


def mutate(monkeypatch, path: str, old: str, new: str) -> None:
    """Load a copy of the module at `path` with `old` replaced by `new` (exactly once) and make
    the code under test use it."""
    source = (ROOT / path).read_text()
    assert source.count(old) == 1, f"the line to mutate is not in {path} once: {old!r}"
    name = path.removesuffix(".py").replace("/", ".") + "_mutated"
    copy = types.ModuleType(name)
    copy.__file__ = str(ROOT / path)
    monkeypatch.setitem(sys.modules, name, copy)  # dataclasses look their module up
    exec(compile(source.replace(old, new), copy.__file__, "exec"), copy.__dict__)
    for module, attribute in USERS[path]:
        monkeypatch.setattr(module, attribute, getattr(copy, attribute))


LAYER2 = [m for m in ledger_mutations.MUTATIONS
          if m.path not in (ledger_mutations.DATA, ledger_mutations.GPT)]


@pytest.mark.parametrize("mutation", LAYER2, ids=lambda m: m.name.split(" (")[0])
def test_the_ledger_catches_a_layer2_mutation(monkeypatch, mutation):
    setup = Setup(w_init=mutation.replicas, g_init=mutation.global_batch_size // mutation.replicas,
                  iterations=4, failures=SCHEDULES[mutation.schedule],
                  overlap="--overlap-grad-reduce" in mutation.extra)
    runs, world = run_lockstep(setup, timeout_s=30)
    check_run(setup, runs, world)  # unmutated: every invariant holds
    mutate(monkeypatch, mutation.path, mutation.old, mutation.new)
    runs, world = run_lockstep(setup, timeout_s=30)
    # The run itself went on: no rank hung or raised, every survivor committed every iteration.
    assert not [run.error for run in runs.values() if run.error], runs
    assert all(len(run.reports) == setup.iterations for run in runs.values() if not run.killed)
    bad = [(rank, r.iteration, r.ledger_problems) for rank, run in runs.items()
           for r in run.reports if not r.invariant_ok]
    assert bad, f"{mutation.name}: not caught"
    rank, iteration, problems = bad[0]
    print(f"CAUGHT {mutation.name}: rank {rank}, iteration {iteration}: {'; '.join(problems)}")


CODEC_MUTATIONS = [
    ("commit lane: loss and tokens swapped", "megatron_recover/recovery/lane.py",
     "values = torch.tensor([head.loss_sum, head.tokens, float(head.exit_requested)],",
     "values = torch.tensor([head.tokens, head.loss_sum, float(head.exit_requested)],",
     Setup(w_init=3, g_init=2)),
    ("replica verdict: replica 0's death unseen", "megatron_recover/recovery/lane.py",
     "return Verdict(dead=replica_set(vector, 0, w),",
     "return Verdict(dead=replica_set(vector, 0, w) - {0},",
     Setup(w_init=4, g_init=2, failures=(Failure(0, 2, "during-reduce", 1),))),
]


@pytest.mark.parametrize("name,path,old,new,setup", CODEC_MUTATIONS,
                         ids=[m[0].split(":")[0] for m in CODEC_MUTATIONS])
def test_a_codec_mutation_is_caught(monkeypatch, name, path, old, new, setup):
    runs, world = run_lockstep(setup, timeout_s=30)
    check_run(setup, runs, world)
    mutate(monkeypatch, path, old, new)
    runs, world = run_lockstep(setup, timeout_s=30)
    assert not [run.error for run in runs.values() if run.error]  # it ran, then deviated
    expected = "logged loss|gradient|invariant|ids missing"
    with pytest.raises(AssertionError, match=expected) as caught:
        check_run(setup, runs, world)
    print(f"CAUGHT {name}: {str(caught.value).splitlines()[0]}")
