"""hybrid-rl as a built package (not the checkout): the wheel carries the Hydra tree, the driver
composes from any directory, a user's own YAML extends ours through `pkg://hybrid_rl.conf`, and
the console commands start."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import yaml

from hybrid_rl.main import REPO_ROOT

USER_CONFIG = """\
# A user's own config, outside both trees: ours is found through the package.
hydra:
  searchpath:
    - pkg://hybrid_rl.conf
defaults:
  - ppo_trainer
  - _self_
actor_rollout_ref:
  rollout:
    n: 3
trainer:
  experiment_name: my_own_yaml
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The package built as a wheel and installed into a folder of its own (no dependencies:
    they come from this environment)."""
    root = tmp_path_factory.mktemp("installed")
    source, wheels, site = root / "source", root / "wheels", root / "site"
    # Built from a copy: setuptools leaves a build/ folder in the tree it builds.
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO_ROOT, name), source / name)
    for name in ("conf", "hybrid_rl"):  # hybrid_rl/conf stays a link, as in the checkout
        shutil.copytree(os.path.join(REPO_ROOT, name), source / name, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(source)], check=True,
                   capture_output=True)
    (wheel,) = wheels.glob("hybrid_rl-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, capture_output=True)
    return site


def config_files(folder) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, files in os.walk(folder) for f in files
                  if "__pycache__" not in d)


def run(args, site, cwd, **kwargs):
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, **kwargs)


def test_the_wheel_carries_the_config_tree_and_composes_from_anywhere(installed, tmp_path):
    done = run([sys.executable, "-c", "import hybrid_rl.config_keys as k; print(k.__file__); print(k.CONF_DIR)"],
               installed, tmp_path)
    module, conf = done.stdout.split()
    assert module.startswith(str(installed)) and conf.startswith(str(installed)), done.stdout  # not the checkout's
    assert config_files(conf) == config_files(os.path.join(REPO_ROOT, "conf"))

    done = run([sys.executable, "-m", "hybrid_rl.main", "--cfg", "job"], installed, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "adv_estimator: grpo" in done.stdout

    done = run([sys.executable, "-m", "hybrid_rl.main", "--config-name=ppo_megatron_trainer", "--cfg", "job"],
               installed, tmp_path)
    assert done.returncode == 0 and "megatron:" in done.stdout, done.stderr[-2000:]


@pytest.mark.parametrize("where", ["installed", "checkout"])
def test_a_users_own_yaml_extends_ours(where, installed, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "my_grpo.yaml").write_text(USER_CONFIG)
    site = installed if where == "installed" else REPO_ROOT
    done = run([sys.executable, "-m", "hybrid_rl.main", "--config-path", str(tmp_path / "mine"),
                "--config-name", "my_grpo", "--cfg", "job", "data.train_batch_size=16"], site, tmp_path)
    assert done.returncode == 0 and "not available" not in done.stderr, done.stderr[-2000:]
    cfg = yaml.safe_load(done.stdout)
    assert cfg["actor_rollout_ref"]["rollout"]["n"] == 3 and cfg["trainer"]["experiment_name"] == "my_own_yaml"
    assert cfg["data"]["train_batch_size"] == 16  # the command line over the user's YAML
    assert cfg["algorithm"]["adv_estimator"] == "grpo"  # and the rest is ours


def test_console_commands(installed, tmp_path):
    for command, expected in (("hybrid-rl-train", "adv_estimator: grpo"), ("hybrid-rl-export", "CHECKPOINT"),
                              ("hybrid-rl-reward-model", "sample,train"), ("hybrid-rl-evaluate", "pass@k")):
        args = ["--cfg", "job"] if command == "hybrid-rl-train" else ["--help"]
        done = run([str(installed / "bin" / command), *args], installed, tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
        assert expected in done.stdout
    done = run([str(installed / "bin" / "hybrid-rl-train"), "actor_rollout_ref.rollout.nn=3"], installed, tmp_path)
    assert done.returncode == 2 and "did you mean actor_rollout_ref.rollout.n?" in done.stderr
