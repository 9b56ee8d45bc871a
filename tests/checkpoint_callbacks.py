"""Checkpoint callbacks (`trainer.checkpoint_callback_class`) for the tests: each records what it
saw, next to the run's checkpoints."""

from __future__ import annotations

import json
import os


class RecordSaves:
    """Appends each call's step and folder, with what was on disk then, to `saves.jsonl` in the run
    folder."""

    def __init__(self, config):
        self.root = config.trainer.default_local_dir

    def on_save(self, trainer, global_step, checkpoint_dir, async_save=False, **kwargs):
        with open(os.path.join(self.root, "latest_checkpointed_iteration.txt")) as pointer:
            latest = int(pointer.read())
        row = {"step": global_step, "folder": checkpoint_dir, "latest": latest, "async_save": async_save,
               # The trainer's state, and the actor's shards: torch.distributed.checkpoint writes
               # their index (.metadata) once every shard is on disk.
               "complete": all(os.path.isfile(os.path.join(checkpoint_dir, *part))
                               for part in (("trainer_state.json",), ("actor", ".metadata"))),
               "trainer_step": trainer.global_step}
        with open(os.path.join(self.root, "saves.jsonl"), "a") as out:
            out.write(json.dumps(row) + "\n")


class FailsToUpload(RecordSaves):
    def on_save(self, trainer, global_step, checkpoint_dir, async_save=False, **kwargs):
        raise ConnectionError("the bucket is unreachable")
