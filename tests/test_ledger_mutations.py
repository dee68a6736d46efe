"""The data-path mutations of scripts/ledger_mutations.py are caught by the ledger invariant of
their own end-to-end runs: a wrong sample fed on one rank (the wiring from megatron's data
pipeline through the schedule's ledger registration to the audit), and a padding microbatch of
the interleaved schedule that keeps its loss mask (it would add a copy of a real microbatch's
gradient; the forward step registers it because its mask is not empty). The layer-2 mutations
(a broken restore, add-back skipped or doubled, an id dropped, a snapshot taken after its bucket
was posted) are caught in process by tests/unit/test_mutations.py; `make mutations` still runs
all of them end to end.

Run: `make test`. CPU only, one small mpirun job each under a hard timeout.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from ledger_mutations import DATA, GPT, MUTATIONS, run  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.e2e]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mutation", [m for m in MUTATIONS if m.path in (DATA, GPT)],
                         ids=lambda m: m.name.split(" (")[0])
def test_mutation_is_caught_by_the_ledger(tmp_path, mutation):
    outcome = run(mutation, tmp_path)
    assert not outcome["timed_out"]
    assert outcome["iterations"] == 4, outcome  # the run itself went on
    assert outcome["caught"], outcome
    print(f"{mutation.name}: {outcome['first_violation']}")
