"""The fault campaign (megatron_recover/faults/campaign.py): its draws, and a bounded slice of it.

Run: `make test` (the draws, and one case on each data plane against one failure-free reference)
and `make test-long` (the slice: 10 cases of a fixed seed over five configurations on the default
data plane, 6-10 minutes, and 5 of them on the mpi plane; CPU only, every run under a hard
timeout); the full campaign is `make fault-campaign N=30 SEED=1`, and `make test-long` runs one
case of it through the README's command.
"""

import json

import pytest

from megatron_recover.faults.campaign import (
    CATALOGUE,
    EXACT_RTOL,
    ITERATIONS,
    Config,
    draw_case,
    run_campaign,
)
from megatron_recover.faults.schedule import LOCATIONS

SLICE_SEED = 8
SLICE_CATALOGUE = (Config(4, "dp"), Config(5, "dp", mode="reserve"), Config(4, "tp2"),
                   Config(4, "do2"), Config(4, "dp", policy="adaptive"))


def test_draws_are_reproducible_and_leave_a_survivor():
    for index in range(200):
        case = draw_case(3, index)
        assert case == draw_case(3, index)  # --seed 3 --case K reruns the same schedule
        victims = [e.replica for e in case.entries]
        assert 1 <= len(victims) <= 4 and len(set(victims)) == len(victims)
        assert len(victims) < case.config.replicas
        for entry in case.entries:
            assert entry.location in LOCATIONS and 2 <= entry.iteration < ITERATIONS
            assert 0 <= entry.local_rank < case.config.ranks_per_replica
            assert entry.location != "param-gather" or case.config.layout == "do2"
    assert draw_case(3, 0) != draw_case(4, 0)
    drawn = {draw_case(1, k).config for k in range(100)}
    assert drawn == set(CATALOGUE)


@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_one_campaign_case_on_each_data_plane(tmp_path, figures):
    """Seed 2's first 4x1 case kills replica 0 (the rank that hosts the torch plane's rebuild
    store) inside a bucket's reduction and replica 3 inside the consensus that follows, in one
    iteration. It runs on the torch plane and then on the mpi plane, both judged against the
    torch plane's failure-free run: each plane recovers exactly, and the two agree."""
    references = {}
    for plane in ("torch", "mpi"):
        lines = []
        summary = run_campaign(1, 2, tmp_path / plane, catalogue=(Config(4, "dp"),),
                               log=lines.append, plane=plane, control=False,
                               references=references)
        figures.append(f"fault campaign case, {plane} data plane: {json.dumps(summary)}")
        assert summary["failed_cases"] == [] and summary["data_plane"] == plane, "\n".join(lines)
        assert summary["failures_injected"] == 2 and summary["ledger_violations"] == 0
        assert summary["max_rel_loss_diff"] <= EXACT_RTOL
        assert summary["max_rel_param_diff"] <= EXACT_RTOL
        for scenario in ("replica 0", "two in one iteration", "extension pass"):
            assert summary["scenarios"].get(scenario), (scenario, summary["scenarios"])
    assert list(references) == [Config(4, "dp").name]  # one reference judged both planes


@pytest.mark.mpi
@pytest.mark.long
@pytest.mark.timeout(1500)
def test_campaign_slice(tmp_path, figures):
    lines = []
    summary = run_campaign(10, SLICE_SEED, tmp_path, catalogue=SLICE_CATALOGUE,
                           log=lambda line: (print(line), lines.append(line)))
    figures.append(f"fault campaign slice: {json.dumps(summary)}")
    assert summary["cases"] == 10 and summary["failed_cases"] == [], "\n".join(lines)
    assert summary["ledger_violations"] == 0
    assert summary["failures_injected"] >= 15
    assert summary["max_rel_loss_diff"] <= EXACT_RTOL
    assert summary["max_rel_param_diff"] <= EXACT_RTOL
    # One lost microbatch gradient moves the loss far beyond the tolerance.
    assert summary["negative_control_rel_loss_diff"] > 100 * EXACT_RTOL
    for scenario in ("two in one iteration", "extension pass", "blocking restore", "grad-norm",
                     "param-gather"):
        assert summary["scenarios"].get(scenario), (scenario, summary["scenarios"])


@pytest.mark.mpi
@pytest.mark.long
@pytest.mark.timeout(1200)
def test_campaign_slice_on_the_mpi_data_plane(tmp_path, figures):
    """The slice above runs on the default data plane (torch); five of its cases again with
    --recover-data-plane mpi (docs/data-planes.md), the negative control left to it."""
    lines = []
    summary = run_campaign(5, SLICE_SEED, tmp_path, catalogue=SLICE_CATALOGUE,
                           log=lambda line: (print(line), lines.append(line)), plane="mpi",
                           control=False)
    figures.append(f"fault campaign slice, mpi data plane: {json.dumps(summary)}")
    assert summary["cases"] == 5 and summary["failed_cases"] == [], "\n".join(lines)
    assert summary["data_plane"] == "mpi" and summary["ledger_violations"] == 0
    assert summary["failures_injected"] >= 10
    assert summary["max_rel_loss_diff"] <= EXACT_RTOL
    assert summary["max_rel_param_diff"] <= EXACT_RTOL
