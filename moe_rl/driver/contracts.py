"""What the driver's schedule (schedule.py) and step loop (loop.steps) ask of the run's parts, named: the
trainer groups (trainer_groups.Models), the engines (rollout_manager.Rollouts) and the checkpoints
(run_checkpoints.Checkpoints). Those classes implement them, and so do the recorders tests/test_schedule.py
runs the real schedule over (tests/test_contracts.py checks both)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from moe_rl.batch import Batch
    from moe_rl.driver.rollout_manager import Collected, InFlight


@runtime_checkable
class SteppingAside(Protocol):
    """The trainer groups, colocated with the engines: off the devices before a rollout, back after."""

    def offload(self) -> dict[str, float]:
        """Hand the devices to the engines; the figures of the move."""

    def onload(self) -> None:
        """Take them back."""


@runtime_checkable
class RolloutSource(Protocol):
    """The engines: a step's rollout started, waited for or finished, the held-out evaluation, and their
    own stepping aside (sleep / wake)."""

    eval_prompts: list[dict]

    def generate(self, step: int) -> InFlight:
        """Start step's rollout on the engines' current weights."""

    def wait(self, rollout: InFlight) -> tuple[Batch, dict[str, float], list]:
        """Its batch, its figures and its episodes, once it has ended."""

    def finish(self, rollout: InFlight) -> Collected:
        """Let it end and keep what it collected (a checkpoint holds it)."""

    def sleep(self) -> None:
        """Free the engines' devices for the trainer."""

    def wake(self, part: str | None = None) -> None:
        """Take them back."""

    def evaluate(self) -> tuple[dict[str, float], list]:
        """The held-out evaluation on the current weights: its figures and episodes."""


@runtime_checkable
class StepCheckpoints(Protocol):
    """The run's checkpoints, as the step loop writes them."""

    def due(self, step: int) -> bool:
        """Whether the state after `step` steps is saved."""

    def save(self, step: int, in_flight: Sequence[InFlight] = ()) -> object:
        """Save it, with the rollouts started for later steps (finished)."""
