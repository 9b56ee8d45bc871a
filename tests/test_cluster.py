"""A real two-node Ray cluster on this machine (a head and a second node, each started with
`ray start`, two CPUs each, token authentication on): placement on distinct nodes, and the training
job submitted to it through the Jobs API (`tools/cluster/ray_job.sh`): one rank per node, the job's
exit code and logs reach the submitter. The job test is skipped where Ray's dashboard (ray[default],
the `cluster` extra) is missing."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from hybrid_rl.controller.worker import get_free_port
from hybrid_rl.main import REPO_ROOT
from tests.conftest import run_overrides

pytestmark = pytest.mark.slow
needs_dashboard = pytest.mark.skipif(importlib.util.find_spec("aiohttp_cors") is None,
                                     reason="ray[default] (the cluster extra) is not installed")


@pytest.fixture(scope="module")
def two_node_cluster():
    """Head + one more node; `ray start --block` stops what it started when terminated, so other
    Ray instances on the machine are left alone."""
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    # Ray's own folder, short: its socket paths must stay under AF_UNIX's 107 bytes, which a
    # pytest-xdist worker's temporary folder exceeds.
    temp = Path(tempfile.mkdtemp(prefix="ray-"))
    port, dashboard = get_free_port(), get_free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    env.pop("RAY_ADDRESS", None)
    common = ["--num-cpus=2", "--num-gpus=0", "--disable-usage-stats", "--block"]
    nodes = []

    def start(name: str, *args: str) -> None:
        # Each node's agents on free ports: another Ray on the machine (a parallel test process's)
        # may hold the default ones, and a head whose job agent cannot bind takes no jobs.
        ports = [f"--dashboard-agent-listen-port={get_free_port()}", f"--dashboard-agent-grpc-port={get_free_port()}",
                 f"--runtime-env-agent-port={get_free_port()}", f"--metrics-export-port={get_free_port()}"]
        with open(temp / f"{name}.log", "w") as log:  # read back when the node does not come up
            nodes.append((subprocess.Popen([ray_bin, "start", *args, *ports, *common], env=env, stdout=log,
                                           stderr=subprocess.STDOUT), log.name))

    try:
        start("head", "--head", f"--port={port}", f"--temp-dir={temp}", "--dashboard-host=127.0.0.1",
              f"--dashboard-port={dashboard}")
        wait_for_nodes(ray_bin, f"127.0.0.1:{port}", nodes, env)
        start("second", f"--address=127.0.0.1:{port}")
        wait_for_nodes(ray_bin, f"127.0.0.1:{port}", nodes, env)
        yield {"env": env, "dashboard": f"http://127.0.0.1:{dashboard}", "address": f"127.0.0.1:{port}"}
    finally:
        for node, _ in reversed(nodes):
            node.terminate()
            node.wait(timeout=60)
        shutil.rmtree(temp, ignore_errors=True)


def wait_for_nodes(ray_bin: str, address: str, nodes: list, env: dict, timeout_s: float = 120) -> None:
    """Until Ray at `address` lists every node started; a node whose `ray start` exits fails at once,
    with its output."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for node, log in nodes:
            if node.poll() is not None:
                raise RuntimeError(f"`ray start` exited with {node.returncode}:\n{open(log).read()[-3000:]}")
        done = subprocess.run([ray_bin, "status", f"--address={address}"], env=env, capture_output=True, text=True)
        if done.returncode == 0 and len(re.findall(r"^ 1 node_", done.stdout, re.M)) >= len(nodes):
            return
        time.sleep(2)
    raise TimeoutError(f"{len(nodes)} Ray node(s) did not come up within {timeout_s} s: {done.stdout}{done.stderr}")


SPREAD_CHECK = """
import json, sys, ray
from hybrid_rl.controller.worker_group import PlacementError, ResourcePool
ray.init(address=sys.argv[1], logging_level="ERROR")
# Each node has room for both groups, so only the strategy keeps them apart.
pool = ResourcePool([1, 1], cpus_per_process=1, strategy="STRICT_SPREAD", timeout_s=60)
nodes = [pool.node_id_of(0), pool.node_id_of(1)]
pool.remove()
try:
    ResourcePool([1, 1, 1], cpus_per_process=1, strategy="STRICT_SPREAD", timeout_s=10)
    error = None
except PlacementError as e:
    error = str(e)
# What the failed attempt reserved was freed: the two groups fit again.
ResourcePool([1, 1], cpus_per_process=1, strategy="STRICT_SPREAD", timeout_s=60).remove()
print(json.dumps({"nodes": nodes, "error": error}))
"""


def test_strict_spread_gives_every_node_group_a_ray_node_of_its_own(two_node_cluster):
    # A process of its own: Ray reads RAY_AUTH_MODE once per process.
    done = subprocess.run([sys.executable, "-c", SPREAD_CHECK, two_node_cluster["address"]], cwd=REPO_ROOT,
                          env=two_node_cluster["env"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["nodes"][0] != result["nodes"][1]
    assert "each on a Ray node of its own" in result["error"] and "2 node(s)" in result["error"]


@needs_dashboard
def test_a_job_submitted_to_two_nodes_trains_with_one_rank_on_each(two_node_cluster, tiny_model_dir,
                                                                   arithmetic_files, tmp_path):
    # The head's job agent can take minutes to come up on a loaded 2-core machine: wait longer for it.
    env = {**two_node_cluster["env"], "RAY_ADDRESS": two_node_cluster["dashboard"], "RAY_JOB_PYTHON": sys.executable,
           "RAY_JOB_AGENT_WAIT_S": "300"}
    overrides = run_overrides(tiny_model_dir, arithmetic_files, tmp_path, 64, 8) + [
        "trainer.nnodes=2", "trainer.n_gpus_per_node=1", "trainer.placement_strategy=STRICT_SPREAD",
        "trainer.cpus_per_worker=1", "trainer.total_training_steps=2", "trainer.test_freq=-1",
        "trainer.val_before_train=false", "trainer.logger=[console,jsonl]", "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "trainer.final_model_dir=null"]
    script = os.path.join(REPO_ROOT, "tools", "cluster", "ray_job.sh")
    done = subprocess.run(["bash", script, *overrides], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    placed = re.search(r"Ranks on Ray nodes: 0 on (\w+) .*, 1 on (\w+) ", done.stdout)
    assert placed and placed[1] != placed[2], done.stdout[-4000:]
    steps = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [m["step"] for m in steps] == [1, 2]

    # A failing job fails the submission, with the driver's one-line error in its logs.
    failed = subprocess.run(["bash", script, *overrides, "data.train_batch_size=3"], env=env, capture_output=True,
                            text=True, timeout=300)
    assert failed.returncode != 0
    assert "error: actor_rollout_ref.actor.ppo_mini_batch_size (4) is larger than data.train_batch_size (3)" in (
        failed.stdout + failed.stderr)


def test_the_submission_script_dry_run_prints_the_command():
    done = subprocess.run(["bash", os.path.join(REPO_ROOT, "tools", "cluster", "ray_job.sh"), "--dry-run",
                           "trainer.nnodes=2", "data.train_files=/data/my train.parquet"],
                          env={**os.environ, "RAY_ADDRESS": "http://head:8265"}, capture_output=True, text=True)
    assert done.returncode == 0 and shutil.which("bash")
    assert done.stdout.strip() == ("ray job submit --address http://head:8265 --runtime-env tools/cluster/runtime_env.yaml "
                                   r"-- python -m hybrid_rl.main trainer.nnodes=2 data.train_files=/data/my\ train.parquet")


FAKE_RAY = """#!/usr/bin/env bash
# Stands in for `ray job submit` on a head whose job agent is not up for the first REFUSALS calls
# (a transient state of a cluster that has just started, which a test cannot bring about on cue);
# after that it reports the submission and exits with JOB_RC, as the real CLI does for the job.
count=$(( $(cat "$CALLS" 2>/dev/null || echo 0) + 1 )); echo $count > "$CALLS"
if (( count <= REFUSALS )); then
  echo "RuntimeError: Request failed with status code 500: No available agent to submit job, please try again later.." >&2
  exit 1
fi
echo "Job 'raysubmit_1' submitted successfully"
echo "No available agent to submit job"  # the job's own output never triggers a resubmission
exit $JOB_RC
"""


@pytest.mark.parametrize("refusals, job_rc, wait_s, calls, rc", [
    (2, 0, 60, 3, 0),   # refused twice, then submitted: succeeds
    (1, 1, 60, 2, 1),   # submitted after one refusal; the job failed: not submitted again
    (5, 0, 0, 1, 1),    # no time to wait: the refusal is the result
])
def test_the_submission_script_resubmits_only_while_the_head_refuses(tmp_path, refusals, job_rc, wait_s, calls, rc):
    fake = tmp_path / "bin" / "ray"
    fake.parent.mkdir()
    fake.write_text(FAKE_RAY)
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}", "CALLS": str(tmp_path / "calls"),
           "REFUSALS": str(refusals), "JOB_RC": str(job_rc), "RAY_JOB_AGENT_WAIT_S": str(wait_s)}
    done = subprocess.run(["bash", os.path.join(REPO_ROOT, "tools", "cluster", "ray_job.sh"), "trainer.nnodes=2"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == rc, done.stdout + done.stderr
    assert int((tmp_path / "calls").read_text()) == calls
    assert done.stderr.count("submitting again in 5 s") == calls - 1


def test_the_kuberay_manifest_matches_its_entrypoint_and_our_config():
    """The RayJob's pods hold exactly the ranks its entrypoint asks for, on the Ray version we
    install, and our config accepts the entrypoint's overrides. (Its schema was checked against
    KubeRay's RayJob CRD once, by hand: docs/cluster.md.)"""
    import shlex

    import ray
    import yaml

    from hybrid_rl.config import validate_config
    from hybrid_rl.main import compose_config

    with open(os.path.join(REPO_ROOT, "tools", "cluster", "kuberay_rayjob.yaml")) as f:
        job = yaml.safe_load(f)
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    command = shlex.split(job["spec"]["entrypoint"])
    assert command[:3] == ["python", "-m", "hybrid_rl.main"]
    cfg = compose_config(command[3:] + ["trainer.device=cpu"])
    validate_config(cfg)
    cluster = job["spec"]["rayClusterSpec"]
    assert cluster["rayVersion"] == ray.__version__
    (workers,) = cluster["workerGroupSpecs"]
    assert workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"] == cfg.trainer.nnodes
    (container,) = workers["template"]["spec"]["containers"]
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == cfg.trainer.n_gpus_per_node
    assert cfg.trainer.placement_strategy == "STRICT_SPREAD"
    assert cluster["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
