"""A step's forward pass with its failures isolated: when the batch fails, each sequence runs alone, so that a row
at fault fails its request alone and the rest go on; when every sequence fails alone, a one-token probe tells a
fault of the requests from one of the engine (docs/robustness.md)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tokenloop.core.executor import Step

from .block_manager import BlockManager
from .model import Model
from .runner import ModelOutput, run
from .sequence import Sequence

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StepRun:
    """What a step's forward pass gave: the scheduled sequences that ran and the model's output for them (None when
    none did); the requests whose sequences failed alone, with their errors (`errors`; the engine turns them into
    `error_steps`); `fault`: the batch's error when every sequence failed alone and the probe failed too."""

    scheduled: list[tuple[Sequence, int]]
    output: ModelOutput | None
    errors: dict[int, Exception] = field(default_factory=dict)
    fault: Exception | None = None
    error_steps: list[Step] = field(default_factory=list)


def run_isolated(model: Model, block_manager: BlockManager, scheduled: list[tuple[Sequence, int]]) -> StepRun:
    """The model over `scheduled`; when the batch fails, each sequence alone (`StepRun`)."""
    try:
        return StepRun(scheduled, run(model, scheduled, block_manager.block_size))
    except Exception as exc:  # noqa: BLE001 - find the rows at fault before failing anyone
        log.exception("engine forward failed for %d sequences; running each alone", len(scheduled))
        batch_error = exc
    outputs, errors = [], {}
    for seq, n in scheduled:
        try:
            outputs.append((seq, run(model, [(seq, n)], block_manager.block_size)))
        except Exception as exc:  # noqa: BLE001 - this sequence's forward fails alone
            errors.setdefault(seq.executor_id, exc)
    ok = [(seq, n) for seq, n in scheduled if seq.executor_id not in errors]
    if not ok:
        return StepRun([], None, errors, None if probe_runs(model, block_manager) else batch_error)
    parts = [output for seq, output in outputs if seq.executor_id not in errors]
    return StepRun(ok, ModelOutput.concat(parts), errors)


def probe_runs(model: Model, block_manager: BlockManager) -> bool:
    """Whether the model still runs a one-token sequence of no request (in a free block, freed after): when it
    does, the sequences that failed alone explain their failure."""
    probe = Sequence(-1, 0, [0], 1)
    if not block_manager.append_slots(probe, 1):
        return False  # no block to try in: count the failure
    try:
        run(model, [(probe, 1)], block_manager.block_size)
        return True
    except Exception:  # noqa: BLE001 - the engine's own fault
        log.exception("the model fails a one-token probe too")
        return False
    finally:
        block_manager.free(probe)
