"""verl's `model.external_lib`: a module that registers a model type transformers does not know is
imported in the driver and in every worker before a model is read, so a run of a model of that
type trains, vLLM engine included; without it the run stops at start naming the config."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from hybrid_rl.config import check_model_limits
from hybrid_rl.config_keys import compose_config
from hybrid_rl.main import REPO_ROOT
from hybrid_rl.models import ModelPathError
from hybrid_rl.user_code import import_external_libs
from tests.conftest import run_overrides

MODULE = "tiny_custom_llama"
# A Llama under a model type of its own, registered with transformers' Auto classes; vLLM finds
# its implementation by the config's architectures (Llama's).
CUSTOM_MODEL = '''
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM


class TinyCustomConfig(LlamaConfig):
    model_type = "tiny_custom_llama"


class TinyCustomForCausalLM(LlamaForCausalLM):
    config_class = TinyCustomConfig


AutoConfig.register("tiny_custom_llama", TinyCustomConfig)
AutoModelForCausalLM.register(TinyCustomConfig, TinyCustomForCausalLM)
'''


@pytest.fixture(scope="module")
def custom_model(tiny_model_dir, tmp_path_factory) -> tuple[str, str]:
    """(the folder of the module, a copy of the tiny model whose config names the new type)."""
    root = tmp_path_factory.mktemp("external_lib")
    (root / "lib").mkdir()
    (root / "lib" / f"{MODULE}.py").write_text(CUSTOM_MODEL)
    model = root / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": MODULE}))
    return str(root / "lib"), str(model)


def test_a_model_of_an_unregistered_type_stops_at_start_and_its_module_registers_it(custom_model):
    lib, model = custom_model
    cfg = compose_config([f"actor_rollout_ref.model.path={model}"])
    with pytest.raises(ModelPathError, match="Cannot read the model config"):
        check_model_limits(cfg, model)
    cfg = compose_config([f"actor_rollout_ref.model.path={model}",
                          f"actor_rollout_ref.model.external_lib={lib}/{MODULE}.py"])
    import_external_libs(cfg)
    check_model_limits(cfg, model)
    with pytest.raises(ValueError, match="actor_rollout_ref.model.external_lib=pkg://no_such_module_here"):
        import_external_libs(OmegaConf.create({"actor_rollout_ref": {"model": {"external_lib": ["no_such_module_here"]}}}))


@pytest.mark.slow
def test_a_run_of_a_custom_model_type_trains_with_its_external_lib(custom_model, arithmetic_files, tmp_path):
    """The command line, with the module named as verl names it (on PYTHONPATH): the driver, the
    worker and its vLLM engine all read the model."""
    lib, model = custom_model
    overrides = run_overrides(model, arithmetic_files, tmp_path, response=8) + [
        f"actor_rollout_ref.model.external_lib={MODULE}", "trainer.total_training_steps=1",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "trainer.cpus_per_worker=1",
        "ray_kwargs.ray_init.num_cpus=2"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (lib, os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-m", "hybrid_rl.main", *overrides], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (metrics,) = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert math.isfinite(metrics["actor/pg_loss"]) and math.isfinite(metrics["actor/grad_norm"])
