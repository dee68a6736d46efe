"""Layer 2: in-step recovery. The round core (`round.Round`: first pass, post, wait, lane,
consensus, verdict, restore or extend, commit) with its registered checks (`checks/`), driven by
`trainer.ResilientTrainer` over typed interfaces (`interfaces.py`); epoch-tagged gradient
snapshots with rewind (`gradients.py`), the gradient ledger that records which microbatch
gradients every bucket holds (`ledger.py`), and the codecs of the commit lane and the replica
verdict (`lane.py`)."""

from megatron_recover.recovery.gradients import GradientRecovery
from megatron_recover.recovery.lane import CommitLane, LaneHead, Verdict, VerdictCodec
from megatron_recover.recovery.ledger import Entry, LaneLayout, LaneTotals, Ledger
from megatron_recover.recovery.trainer import ResilientTrainer, StepReport, TrainerParts

__all__ = ["CommitLane", "Entry", "GradientRecovery", "LaneHead", "LaneLayout", "LaneTotals",
           "Ledger", "ResilientTrainer", "StepReport", "TrainerParts", "Verdict", "VerdictCodec"]
