"""What one committed iteration did: one JSONL record of the recovery log."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepReport:
    """What one committed iteration did; one JSONL record of the recovery log. The round core
    fills the first fields; each registered check fills its own (`checks/`)."""

    iteration: int
    loss: float
    contributions: int  # microbatch gradients in the committed buckets (the ledger's count)
    B: int
    live_replicas: int
    epoch: int
    ledger_checksum: int  # sum of the committed batches' checksums (this position)
    grad_norm: float | None
    loss_scale: float  # the optimizer's loss scale after this step (1.0 without fp16 scaling)
    skipped: bool  # the fp16 loss scaler found inf/nan: no update, the lr scheduler kept still
    iteration_ms: float
    extension_rounds: int
    buckets: int
    events: list[dict] = field(default_factory=list)
    loss_tokens: int | None = None  # per-token loss: the committed loss tokens
    own_contributions: int = 0  # microbatch gradients this rank's buckets sent to the commit
    g_cur: int = 0  # the layout's microbatches per major replica when the iteration began
    exit_requested: bool = False  # some rank asked to stop after this iteration
    committed_s: float = 0.0  # when the round committed (time.time(), this rank's clock)
    # The first round's cross-replica reductions, from the ulfm worker's timestamps: how long
    # some reduction was running, how much of that before the pass returned (hidden under
    # backward), and this rank's snapshot and gradient-buffer bytes.
    reduction: dict = field(default_factory=dict)
    quotas: dict = field(default_factory=dict)  # each replica's first-pass microbatches
    # The ledger audit (`checks/ledger_audit.py`): whether the committed ledger is the expected
    # one at every position, and what this position's audit found (empty when it holds).
    invariant_ok: bool = True
    ledger_problems: list[str] = field(default_factory=list)
    verified: int = 0  # microbatches whose gradients two replicas computed and agreed on
    # Straggler handling (`checks/stragglers.py`): the agreed seconds per microbatch, the
    # replicas the next layout treats as slow and the ones evicted at this commit.
    speeds: dict = field(default_factory=dict)
    slow: list = field(default_factory=list)
    evicted: list = field(default_factory=list)
    side_sums: list = field(default_factory=list)  # committed side sums, replica-wide
