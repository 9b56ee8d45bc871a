"""verl's `trainer.checkpoint_callback_class`: refusals at start, and a failing on_save stopping the
run with the checkpoint intact (its calls in a real run, after each complete checkpoint:
tests/test_resume.py); and the checkpoint before the capacity block ends (`trainer.esi_redundant_time`;
in a real run: tests/test_stop.py)."""

from __future__ import annotations

import pytest

from hybrid_rl.checkpoint import (CAPACITY_BLOCK_END_VARS, CheckpointCallbackError, CheckpointManager,
                                  build_checkpoint_callback, capacity_block_ending, run_checkpoint_callback)
from hybrid_rl.config_keys import compose_config

KEY = "trainer.checkpoint_callback_class"


def config(tmp_path, name):
    return compose_config([f"{KEY}={name}", f"trainer.default_local_dir={tmp_path}"])


def test_unset_means_no_callback(tmp_path):
    assert build_checkpoint_callback(compose_config([])) is None


@pytest.mark.parametrize("name, message", [
    ("RecordSaves", "must be a fully qualified class name, package.module.Class"),
    ("tests.no_such_module.RecordSaves", "importing the module tests.no_such_module failed"),
    ("tests.checkpoint_callbacks.RecordSave", "has no class 'RecordSave'; its classes: FailsToUpload, RecordSaves"),
    ("tests.checkpoint_callbacks.json", "has no class 'json'"),
    ("collections.OrderedDict", "the class has no on_save method"),
])
def test_a_bad_class_name_is_refused_before_the_run_starts(tmp_path, name, message):
    with pytest.raises(ValueError, match=message):
        build_checkpoint_callback(config(tmp_path, name))


def test_a_failing_upload_stops_the_run_and_says_the_checkpoint_is_intact(tmp_path):
    callback = build_checkpoint_callback(config(tmp_path, "tests.checkpoint_callbacks.FailsToUpload"))
    folder = CheckpointManager(str(tmp_path)).save(3, lambda folder: None, {"global_step": 3})
    with pytest.raises(CheckpointCallbackError) as error:
        run_checkpoint_callback(callback, None, 3, folder)
    assert str(error.value).startswith(f"{KEY}: FailsToUpload.on_save failed for checkpoint {folder} with "
                                       "ConnectionError: the bucket is unreachable. The checkpoint is complete")
    assert CheckpointManager(str(tmp_path)).latest() == folder


@pytest.mark.parametrize("variable", CAPACITY_BLOCK_END_VARS)
def test_a_checkpoint_is_due_once_the_capacity_block_ends_before_another_step_and_checkpoint(monkeypatch, variable):
    """60 s to write it + the longest step so far + trainer.esi_redundant_time, as verl decides."""
    for name in CAPACITY_BLOCK_END_VARS:
        monkeypatch.delenv(name, raising=False)
    assert not capacity_block_ending(30.0, 0.0, now=1000.0)  # no capacity block
    monkeypatch.setenv(variable, "1100")
    assert capacity_block_ending(30.0, 10.0, now=1000.0)  # 100 s left <= 60 + 30 + 10
    assert not capacity_block_ending(30.0, 9.0, now=1000.0)  # 100 > 99
    assert not capacity_block_ending(0.0, 100.0, now=1000.0)  # no step timed yet
    assert not capacity_block_ending(30.0, 10.0, now=1200.0)  # already over
    monkeypatch.setenv(variable, "soon")
    assert not capacity_block_ending(30.0, 10.0, now=1000.0)
