"""The rollout cache (verl's `skip`): a training step's generated batch saved to disk, and loaded
in a later run instead of generating, so what follows the rollout (the reward function,
advantages, the update) can be debugged or compared without waiting on generation.

A run's dumps live in `<dump_dir>/<experiment>_<project>/GBS<prompts>_N<n>_in<prompt>_out<response>/`,
one folder per step, one file per generation batch of the step (dynamic sampling draws more
than one). Each file holds the step's prompts (with their group uids) and the rollout's output
for them, so a loaded step trains on the prompts it was generated for. Files are pickles: load
only dumps your own runs wrote.

Which steps the cache serves, and with what, follows verl's three forms of the switch:
- verl 0.9 (`skip.rollout`): only the listed steps. `cache`: a step's own dump, else generate and
  dump it; `repeat`: the nearest dump (the step's own, else the latest earlier one, else the
  earliest later one), else generate and dump.
- verl 0.7-0.8 (`rollout.skip`): the first `max_dump_step` steps load their own dump or generate
  and dump it; later steps generate (`cache`), cycle through the dumps (`repeat`: step s takes
  the ((s - 1) mod d)-th of d dumps) or take the latest dump (`repeat_last`).
- verl 0.5-0.6 (`rollout.skip_rollout`): the first step's dump serves every step (0.7's form with
  max_dump_step=1, repeat_last).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from hybrid_rl.protocol import Batch

logger = logging.getLogger(__name__)

# How a step is served: its own dump; the nearest dump; the dumps in turn; the latest dump.
EXACT, NEAREST, CYCLE, LAST = "exact", "nearest", "cycle", "last"


def dump_folder(dump_dir: str, experiment: str, project: str, prompts_per_step: int, n: int, prompt_length: int,
                response_length: int) -> Path:
    """Where a run's dumps go: runs whose batches have another shape do not share them."""
    return (Path(dump_dir).expanduser().resolve() / f"{experiment}_{project}"
            / f"GBS{prompts_per_step}_N{n}_in{prompt_length}_out{response_length}")


def source_step(mode: str, step: int, dumped: list[int]) -> int | None:
    """The dumped step (of the sorted `dumped`) that serves `step` under `mode`; None: none does,
    generate."""
    if mode == EXACT or step in dumped:
        return step if step in dumped else None
    if not dumped:
        return None
    if mode == NEAREST:
        earlier = [s for s in dumped if s < step]
        return earlier[-1] if earlier else dumped[0]
    if mode == CYCLE:
        return dumped[(step - 1) % len(dumped)]
    return dumped[-1]


@dataclass
class Lookup:
    """What the cache has for one generation batch of `step`: `loaded` (the prompts, the generated
    batch and the step they were dumped at), or None, and then `dump_to`, the (step, batch) that
    `RolloutCache.save` writes what is generated instead to (None: it is not dumped)."""

    step: int
    loaded: tuple[Batch, Batch, int] | None = None
    dump_to: tuple[int, int] | None = None


class RolloutCache:
    """Serves training steps from dumped rollouts and dumps the steps it could not serve.

    `steps`: the steps it serves (verl 0.9's form), or None for the first `max_dump_step` steps
    and a rule for the later ones (verl 0.7's form); `action` as in verl (module docstring).
    Lookups come in step order; a rollout pool that generates ahead holds several unsaved ones."""

    def __init__(self, folder: Path, action: str, steps: list[int] | None = None, max_dump_step: int = 1):
        self.folder = folder
        self.action = action
        self.steps = None if steps is None else frozenset(steps)
        self.max_dump_step = max_dump_step
        self._generation = (0, 0)  # (step, generation batches of it so far)

    def mode(self, step: int) -> str | None:
        """How `step` is served; None: it is generated and not dumped."""
        if self.steps is not None:
            return (EXACT if self.action == "cache" else NEAREST) if step in self.steps else None
        if step <= self.max_dump_step:
            return EXACT
        return {"cache": None, "repeat": CYCLE, "repeat_last": LAST}[self.action]

    def dumped_steps(self) -> list[int]:
        """The steps with a dump in the folder, sorted (a step counts once its first batch is there)."""
        if not self.folder.is_dir():
            return []
        return sorted(int(child.name) for child in self.folder.iterdir()
                      if child.name.isdigit() and self._path(int(child.name), 0).is_file())

    def _path(self, step: int, batch: int) -> Path:
        return self.folder / str(step) / f"generation_{batch}.pt"

    def load(self, step: int) -> Lookup:
        """The next generation batch of `step`: loaded from a dump where one serves it, else where
        `save` is to dump what is generated for it."""
        batch = self._generation[1] if self._generation[0] == step else 0
        self._generation = (step, batch + 1)
        mode = self.mode(step)
        if mode is None:
            return Lookup(step)
        source = source_step(mode, step, self.dumped_steps())
        path = None if source is None else self._path(source, batch)
        if path is not None and path.is_file():
            saved = torch.load(path, weights_only=False)
            logger.info("Rollout cache: step %d generation %d loaded from %s", step, batch, path)
            return Lookup(step, loaded=(_batch(saved["prompts"]), _batch(saved["generated"]), source))
        # A later generation batch that another step's dump lacks is generated, not dumped there.
        return Lookup(step, dump_to=(step, batch) if source in (None, step) else None)

    def save(self, lookup: Lookup, prompts: Batch, generated: Batch) -> None:
        """Dump what was generated for a lookup that found nothing, when the cache serves its step.
        Written to a temporary file and renamed, so a run stopped mid-write leaves no partial dump."""
        if lookup.dump_to is None:
            return
        path = self._path(*lookup.dump_to)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        torch.save({"prompts": _plain(prompts), "generated": _plain(generated)}, partial)
        os.replace(partial, path)
        logger.info("Rollout cache: step %d dumped to %s", lookup.step, path)


def _plain(batch: Batch) -> dict:
    """A batch as tensors and lists, independent of how this version's classes are laid out."""
    return {"tensors": {key: batch.tensors[key] for key in batch.tensors.keys()},
            "non_tensors": {key: list(values) for key, values in batch.non_tensors.items()}}


def _batch(saved: dict) -> Batch:
    return Batch(saved["tensors"], saved["non_tensors"])
