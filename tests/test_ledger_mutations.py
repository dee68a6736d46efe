"""Each mutation of scripts/ledger_mutations.py (a broken restore, add-back skipped or doubled,
an id dropped, a wrong sample on one rank, a snapshot taken after its bucket was posted) is
caught by the ledger invariant of its own run.

Run: `make test`. CPU only, six small mpirun jobs under hard timeouts, about a minute.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from ledger_mutations import MUTATIONS, run  # noqa: E402

pytestmark = pytest.mark.mpi


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name.split(" (")[0])
def test_mutation_is_caught_by_the_ledger(tmp_path, mutation):
    outcome = run(mutation, tmp_path)
    assert not outcome["timed_out"]
    assert outcome["iterations"] == 4, outcome  # the run itself went on
    assert outcome["caught"], outcome
    print(f"{mutation.name}: {outcome['first_violation']}")
