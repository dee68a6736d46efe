"""What a lockstep run (`lockstep.run_lockstep`) must show, checked from what happened.

`check_run` raises AssertionError naming the first thing that does not hold. The expected side
never comes from the policy's plan: the failure-free gradient and the committed gradient are
computed from the dataset alone (`lockstep.failure_free_gradient`, `expected_gradient`), the
ledger is judged by the real `DatasetAudit`, and the kills are read from the fake world's log.
"""

from __future__ import annotations

import torch

from megatron_recover.policy import ADAPTIVE, EXACT, STATIC
from megatron_recover.testing.lockstep import (
    LEARNING_RATE,
    Setup,
    expected_gradient,
    failure_free_gradient,
    microbatch,
    sample_range,
)

# Points every live replica reaches in every iteration (the others need a restore or an
# extension pass to happen).
ALWAYS_REACHED = ("pre-forward", "before-reduce", "after-post", "during-reduce",
                  "reduce-contributed", "during-lane", "in-consensus", "optimizer-step")


def check_run(setup: Setup, runs: dict, world) -> list[int]:
    """Check every invariant of one lockstep run; returns the survivors."""
    errors = {rank: run.error for rank, run in runs.items() if run.error is not None}
    assert not errors, f"ranks raised: {errors!r}"
    killed = {rank for event, rank, _ in world.log if event == "killed"}
    died = {rank for rank, run in runs.items() if run.killed}
    assert killed == died, f"the world killed {sorted(killed)}, the threads that died {died}"
    named = {f.replica for f in setup.failures}
    assert killed <= named, f"ranks {sorted(killed - named)} died without a scheduled failure"
    for f in setup.failures:
        if f.location in ALWAYS_REACHED and f.iteration <= setup.iterations:
            assert f.replica in killed, f"{f} never fired"
    survivors = sorted(set(runs) - died)
    assert survivors, "no survivor"
    first = runs[survivors[0]]
    b = setup.w_init * setup.g_init
    for rank in survivors:
        run = runs[rank]
        assert [r.iteration for r in run.reports] == list(range(1, setup.iterations + 1)), (
            f"rank {rank} committed iterations {[r.iteration for r in run.reports]}")
        audit = run.replica.audit
        stepped = run.replica.optimizer.stepped
        assert len(stepped) == len(run.reports), (rank, len(stepped), len(run.reports))
        # Every pass divided its losses by B, every step advanced the schedule by B.
        assert set(run.replica.run_pass.divisors) <= {b}, run.replica.run_pass.divisors
        assert set(run.replica.optimizer.microbatches) == {b}, run.replica.optimizer.microbatches
        for report, grad in zip(run.reports, stepped):
            t = report.iteration
            assert report.invariant_ok, f"rank {rank} iteration {t}: {report.ledger_problems}"
            totals = audit.totals[t]
            assert report.contributions == totals.count
            if setup.policy == STATIC:
                assert totals.count == b, f"iteration {t} committed {totals.count}, B = {b}"
            held = [(k, n) for k, n in enumerate(totals.main_counts) if n]
            held += [(k, 1) for k in totals.reserve]
            committed = [(n, microbatch(audit.dataset, sample_range(audit, t, k)))
                         for k, n in held]
            loss = sum(n * m[2] for n, m in committed)
            tokens = sum(n * m[1] for n, m in committed)
            assert report.loss == loss / max(tokens, 1), (
                f"rank {rank} iteration {t}: logged loss {report.loss}, the committed "
                f"microbatches' loss sums over their {tokens} loss tokens give "
                f"{loss / max(tokens, 1)}")
            expected = expected_gradient(setup, audit, t, totals)
            assert torch.equal(grad, expected), (
                f"rank {rank} iteration {t}: the stepped gradient is not the sum of the "
                f"gradients its ledger names (max diff {(grad - expected).abs().max():g})")
            if setup.policy == STATIC and setup.mode == EXACT:
                assert totals.main_ids == tuple(range(b)) and not totals.reserve
                assert torch.equal(grad, failure_free_gradient(audit, t)), (
                    f"rank {rank} iteration {t}: not the failure-free gradient")
        mine = [(r.loss, r.contributions, r.epoch, r.live_replicas, r.ledger_checksum)
                for r in run.reports]
        theirs = [(r.loss, r.contributions, r.epoch, r.live_replicas, r.ledger_checksum)
                  for r in first.reports]
        assert mine == theirs, f"ranks {rank} and {survivors[0]} report differently"
        assert torch.equal(run.replica.optimizer.params, first.replica.optimizer.params), (
            f"survivors {rank} and {survivors[0]} hold different parameters")
    if setup.policy == STATIC and setup.mode == EXACT:
        audit = first.replica.audit
        reference = torch.zeros_like(first.replica.optimizer.params)
        for t in range(1, setup.iterations + 1):
            reference.sub_(LEARNING_RATE * failure_free_gradient(audit, t))
        assert torch.equal(first.replica.optimizer.params, reference), (
            "the survivors' parameters differ from the failure-free run's")
    if setup.mode != EXACT or setup.policy == ADAPTIVE:
        reserve = [k for t in first.replica.audit.totals.values() for k in t.reserve]
        assert len(reserve) == len(set(reserve)), f"a reserve id committed twice: {reserve}"
    return survivors
