"""Crash-safe checkpoints of a whole run, laid out like verl's:

    <trainer.default_local_dir>/
        global_step_<N>/
            actor/   critic/        sharded model + optimizer (torch.distributed.checkpoint),
                                    per-rank scheduler and RNG states
            trainer_state.json      step, data sampler position, KL controller, reward statistics,
                                    the resolved config
        latest_checkpointed_iteration.txt

A checkpoint is written into a hidden temporary folder and renamed into place only when every
part is on disk; the `latest` pointer is replaced atomically after that. A crash at any moment
therefore leaves the previous checkpoint, and the pointer to it, intact. With verl's
`trainer.default_hdfs_dir` each complete checkpoint is then copied there too (`mirror_checkpoint`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hybrid_rl.engines.base import CHECKPOINT_PARTS

logger = logging.getLogger(__name__)

POINTER = "latest_checkpointed_iteration.txt"
STATE = "trainer_state.json"
STEP_DIR = re.compile(r"^global_step_(\d+)$")
CRITIC = "critic"


class CheckpointError(ValueError):
    pass


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


@dataclass(frozen=True)
class PendingCheckpoint:
    """A checkpoint `begin` has written, or whose writes are still under way: not yet the latest."""
    step: int
    folder: Path


class CheckpointManager:
    """`max_to_keep` (trainer.max_actor_ckpt_to_keep): the newest checkpoints kept whole;
    `max_critic_to_keep` (trainer.max_critic_ckpt_to_keep): of those, the newest that keep their
    `critic/` part (the others can still be exported, not resumed by PPO). None or <= 0: all."""

    def __init__(self, root: str, max_to_keep: int | None = None, max_critic_to_keep: int | None = None):
        self.root = Path(os.path.expanduser(root))
        self.max_to_keep = max_to_keep
        self.max_critic_to_keep = max_critic_to_keep

    def save(self, step: int, write_parts: Callable[[str], None], trainer_state: dict,
             before_commit: Callable[[], None] | None = None) -> Path:
        """`write_parts(folder)` has the workers write their shards under `folder`;
        `before_commit()` runs once everything is written, before the checkpoint becomes the
        latest."""
        return self.commit(self.begin(step, write_parts, trainer_state), before_commit=before_commit)

    def begin(self, step: int, write_parts: Callable[[str], None], trainer_state: dict) -> PendingCheckpoint:
        """The first half of `save`: the parts written (or, by workers saving in the background,
        begun) into a hidden folder, which `commit` makes the checkpoint."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp_global_step_{step}_{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            write_parts(str(tmp))
            _write_atomic(tmp / STATE, json.dumps(trainer_state, indent=1))
        except BaseException:  # a failure or a second Ctrl-C: leave no half-written folder behind
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return PendingCheckpoint(step, tmp)

    def commit(self, pending: PendingCheckpoint, wait: Callable[[], None] | None = None,
               before_commit: Callable[[], None] | None = None) -> Path:
        """`wait()` returns once the workers' background writes are on disk, `before_commit()`
        runs after it; then the checkpoint is renamed into place and becomes the latest."""
        step, tmp = pending.step, pending.folder
        try:
            if wait is not None:
                wait()
            if before_commit is not None:
                before_commit()
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        final = self.root / f"global_step_{step}"
        if final.exists():  # the same step saved again after a resume: replace it whole
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        _write_atomic(self.root / POINTER, str(step))
        self._rotate()
        logger.info("Saved checkpoint %s", final)
        return final

    def _rotate(self) -> None:
        if self.max_critic_to_keep and self.max_critic_to_keep > 0:
            for old in self.completed()[:-self.max_critic_to_keep]:
                shutil.rmtree(old / CRITIC, ignore_errors=True)
        if not self.max_to_keep or self.max_to_keep <= 0:
            return
        for old in self.completed()[:-self.max_to_keep]:
            shutil.rmtree(old, ignore_errors=True)
        # Leftovers of saves interrupted by a crash.
        for tmp in self.root.glob(".tmp_global_step_*"):
            shutil.rmtree(tmp, ignore_errors=True)

    def critic_folder(self, folder: Path) -> Path:
        """The critic's part of checkpoint `folder`, which a PPO run resumes from."""
        critic = Path(folder) / CRITIC
        if not critic.is_dir():
            with_critic = [p.name for p in self.completed() if (p / CRITIC).is_dir()]
            raise CheckpointError(
                f"{folder} holds no critic (trainer.max_critic_ckpt_to_keep removes it from older checkpoints, "
                f"and a run without a critic saves none), so a run with a critic cannot resume from it. Resume from "
                f"one that has it with trainer.resume_mode=resume_path trainer.resume_from_path=<folder> (here: "
                f"{with_critic or 'none'}), or start over with trainer.resume_mode=disable.")
        return critic

    def completed(self) -> list[Path]:
        steps = [(int(m.group(1)), p) for p in self.root.glob("global_step_*")
                 if (m := STEP_DIR.match(p.name)) and (p / STATE).is_file()]
        return [p for _, p in sorted(steps)]

    def latest(self) -> Path | None:
        pointer = self.root / POINTER
        if not pointer.is_file():
            return None
        folder = self.root / f"global_step_{pointer.read_text().strip()}"
        if not (folder / STATE).is_file():
            raise CheckpointError(
                f"{pointer} points to {folder}, which is missing or incomplete. Delete the pointer to "
                "start over, or resume from a complete checkpoint with trainer.resume_mode=resume_path "
                f"trainer.resume_from_path=<folder> (complete ones: {[p.name for p in self.completed()]}).")
        return folder

    def resume_folder(self, mode: str, path: str | None) -> Path | None:
        """The checkpoint to resume from under `trainer.resume_mode`, or None to start fresh."""
        if mode == "disable":
            return None
        if mode == "auto":
            return self.latest()
        if mode == "resume_path":
            if not path:
                raise CheckpointError("trainer.resume_mode=resume_path needs trainer.resume_from_path=<.../global_step_N>.")
            folder = Path(os.path.expanduser(path))
            if not folder.is_dir():
                raise CheckpointError(f"trainer.resume_from_path={path} does not exist.")
            if not (folder / STATE).is_file():
                raise CheckpointError(f"trainer.resume_from_path={path} is not a complete checkpoint (no {STATE}); "
                                      "point it at a global_step_<N> folder written by hybrid-rl.")
            return folder
        raise CheckpointError(f"trainer.resume_mode={mode!r} is not valid. Valid choices: auto, disable, resume_path.")


# What starts afresh where a resume leaves a part of the checkpoint out.
FRESH_PARTS = {"optimizer": "optimizer state", "extra": "learning-rate schedule and RNG states"}


def narrowed_load_contents(checkpoint_cfg) -> list[str] | None:
    """A role's verl `checkpoint.load_contents` where it narrows what a resume loads: None where it
    is unset or equal to save_contents (its default), which here never narrows what is saved."""
    loaded = checkpoint_cfg.get("load_contents")
    if loaded is None or list(loaded) == list(checkpoint_cfg.get("save_contents") or []):
        return None
    return list(loaded)


def parts_to_load(checkpoint_cfg, role_key: str, folder) -> tuple[str, ...]:
    """What a resume loads of a role's checkpoint: all, or the parts a narrowing load_contents
    names (a warning says what starts afresh)."""
    loaded = narrowed_load_contents(checkpoint_cfg)
    if loaded is None:
        return CHECKPOINT_PARTS
    parts = tuple(part for part in CHECKPOINT_PARTS if part in loaded)
    fresh = [FRESH_PARTS[part] for part in CHECKPOINT_PARTS if part not in parts]
    if fresh:
        logger.warning("Resuming from %s with the %s of %s's checkpoint only (%s.checkpoint.load_contents): it starts "
                       "with a fresh %s, so this run does not go on as the saved one would have.",
                       folder, " and ".join(parts), role_key, role_key, " and ".join(fresh))
    return parts


def read_trainer_state(folder: Path) -> dict:
    try:
        return json.loads((folder / STATE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"Cannot read {folder / STATE} ({exc}); the checkpoint is corrupt. Resume from an "
                              "earlier global_step_<N> folder with trainer.resume_mode=resume_path.") from exc


# When the machines' capacity block ends (seconds since the epoch), as Volcano Engine's machine
# learning platform and AWS SageMaker's training plans tell their jobs (verl reads the same).
CAPACITY_BLOCK_END_VARS = ("MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP",
                           "SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP")
CHECKPOINT_SECONDS = 60  # what verl allows for writing one


def capacity_block_ending(longest_step_seconds: float, spare_seconds: float, now: float | None = None) -> bool:
    """Whether the capacity block ends before another step and a checkpoint could be done:
    0 < seconds left <= 60 + the longest step so far + `spare_seconds` (verl's
    trainer.esi_redundant_time). False where neither variable is set or readable."""
    for name in CAPACITY_BLOCK_END_VARS:
        value = os.environ.get(name)
        if value:
            try:
                left = float(value) - (time.time() if now is None else now)
            except ValueError:
                logger.warning("%s=%r is not a timestamp; the checkpoint before the capacity block ends is not "
                               "scheduled.", name, value)
                return False
            return longest_step_seconds > 0 and 0 < left <= CHECKPOINT_SECONDS + longest_step_seconds + spare_seconds
    return False


MIRROR_KEY = "trainer.default_hdfs_dir"


def mirror_file_system(destination: str):
    """The fsspec file system and root path of `trainer.default_hdfs_dir` (a folder, or a URL of
    any file system fsspec has: hdfs:// through pyarrow, s3:// with s3fs, ...)."""
    import fsspec

    try:
        return fsspec.core.url_to_fs(destination)
    except (ImportError, ValueError) as exc:
        raise ValueError(f"{MIRROR_KEY}={destination}: no file system for it ({exc}); install the package named, "
                         "or give a local or mounted folder.") from None


class CheckpointMirrorError(RuntimeError):
    """Copying a complete checkpoint to trainer.default_hdfs_dir failed; the local one is intact."""


def mirror_checkpoint(folder: Path, destination: str) -> str:
    """verl's `trainer.default_hdfs_dir`: the complete checkpoint `folder` copied to
    `<destination>/<its name>`, written under a hidden name and moved into place when whole, and
    a `latest` pointer beside it as in default_local_dir (which runs resume from). Copies are kept:
    max_*_ckpt_to_keep rotates the local ones only. Returns the copy's path."""
    fs, root = mirror_file_system(destination)
    root = root.rstrip("/")
    target, hidden = f"{root}/{folder.name}", f"{root}/.tmp_{folder.name}_{uuid.uuid4().hex[:8]}"
    try:
        fs.makedirs(root, exist_ok=True)
        fs.put(str(folder), hidden, recursive=True)
        if fs.exists(target):  # the same step saved again after a resume
            fs.rm(target, recursive=True)
        fs.mv(hidden, target, recursive=True)
        fs.pipe_file(f"{root}/{POINTER}", folder.name.removeprefix("global_step_").encode())
    except Exception as exc:
        with contextlib.suppress(Exception):  # no half copy left behind where it can be removed
            fs.rm(hidden, recursive=True)
        raise CheckpointMirrorError(
            f"{MIRROR_KEY}: copying checkpoint {folder} to {destination} failed with {type(exc).__name__}: {exc}. "
            f"The checkpoint is complete in its own folder; fix {MIRROR_KEY} (or set it to null) and rerun the "
            "same command to resume from it.") from exc
    logger.info("Copied checkpoint %s to %s", folder, target)
    return target


CALLBACK_KEY = "trainer.checkpoint_callback_class"


def build_checkpoint_callback(cfg):
    """verl's `trainer.checkpoint_callback_class`: the class (package.module.Class) is built in the
    driver with `config=` the run's config, and its `on_save(trainer=, global_step=,
    checkpoint_dir=, async_save=False)` runs after each checkpoint is complete and the latest
    (uploading it, registering a model version). verl's base class is not needed: any class with
    that method. None when the key is unset."""
    from hybrid_rl.user_code import load_class

    name = cfg.trainer.get("checkpoint_callback_class")
    if not name:
        return None
    cls = load_class(name, CALLBACK_KEY)
    if not callable(getattr(cls, "on_save", None)):
        raise ValueError(f"{CALLBACK_KEY}={name}: the class has no on_save method; define "
                         "on_save(self, trainer, global_step, checkpoint_dir, async_save=False, **kwargs).")
    try:
        return cls(config=cfg)
    except Exception as exc:  # re-raised with the setting to fix
        raise ValueError(f"{CALLBACK_KEY}={name}: building it as {cls.__name__}(config=<the run's config>) failed "
                         f"with {type(exc).__name__}: {exc}") from exc


class CheckpointCallbackError(RuntimeError):
    """The checkpoint callback's on_save raised; the checkpoint itself is complete."""


def run_checkpoint_callback(callback, trainer, step: int, folder: Path) -> None:
    """`callback.on_save` for the checkpoint just completed. Its failure stops the run (an upload
    it was to make did not happen), saying that the checkpoint is intact."""
    try:
        callback.on_save(trainer=trainer, global_step=step, checkpoint_dir=str(folder), async_save=False)
    except Exception as exc:
        raise CheckpointCallbackError(
            f"{CALLBACK_KEY}: {type(callback).__name__}.on_save failed for checkpoint {folder} with "
            f"{type(exc).__name__}: {exc}. The checkpoint is complete; fix the callback and rerun the same command "
            "to resume from it (the callback is not called again for it).") from exc
