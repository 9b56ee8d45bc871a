"""tools/cluster/slurm_ray.sbatch under a real SLURM: Debian's slurmctld and two slurmd nodes on
this machine (one CPU each), a munge daemon of the test's own, all configured in a temporary
folder. The script starts Ray over the allocation, the job trains with one rank per node, exits 0,
and `scancel` mid-run leaves no Ray process behind and the checkpoints intact.

Skipped where SLURM or munge is not installed (`apt-get install slurmctld slurmd slurm-client
munge`) or without root (the daemons run as root here)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from hybrid_rl.controller.worker import get_free_port
from hybrid_rl.main import REPO_ROOT
from tests.conftest import run_overrides

DAEMONS = ("slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "munged")
pytestmark = pytest.mark.slow
needs_slurm = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(d) or os.path.exists(f"/usr/sbin/{d}") for d in DAEMONS),
    reason="needs root and SLURM + munge (apt-get install slurmctld slurmd slurm-client munge)")

SCRIPT = os.path.join(REPO_ROOT, "tools", "cluster", "slurm_ray.sbatch")


def binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool_n1", "spool_n2", "log"):
        (root / sub).mkdir()
    sock = root / "munge.sock"
    subprocess.run([binary("munged"), f"--socket={sock}", "--key-file=/etc/munge/munge.key", "--force",
                    f"--pid-file={root / 'munged.pid'}", f"--log-file={root / 'munged.log'}",
                    f"--seed-file={root / 'munged.seed'}"], check=True)
    host = socket.gethostname()
    conf = root / "slurm.conf"
    conf.write_text(f"""\
ClusterName=hybridrltest
SlurmctldHost={host}
SlurmctldPort={get_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={sock}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool_%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd_%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd_%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
NodeName=n1 NodeHostname={host} NodeAddr=127.0.0.1 Port={get_free_port()} CPUs=1 State=UNKNOWN
NodeName=n2 NodeHostname={host} NodeAddr=127.0.0.1 Port={get_free_port()} CPUs=1 State=UNKNOWN
PartitionName=test Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
""")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons = [subprocess.Popen([binary("slurmctld"), "-D", "-c"], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)]
    time.sleep(2)
    daemons += [subprocess.Popen([binary("slurmd"), "-D", "-N", node], env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL) for node in ("n1", "n2")]
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            info = subprocess.run(["sinfo", "-h", "-o", "%T %D"], env=env, capture_output=True, text=True).stdout
            if info.strip() == "idle 2":
                break
            time.sleep(1)
        else:
            raise TimeoutError(f"the two SLURM nodes did not come up: {info!r}")
        yield env
    finally:
        for daemon in reversed(daemons):
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(timeout=60)
        subprocess.run([binary("munged"), f"--socket={sock}", "--stop"], capture_output=True)


def submit(env: dict, out, overrides: list[str]) -> str:
    # The driver and Ray of the job use this interpreter's environment and ports of their own.
    job_env = {**env, "HYBRID_RL_VENV": os.path.dirname(os.path.dirname(sys.executable)),
               "RAY_PORT": str(get_free_port()), "RAY_DASHBOARD_PORT": str(get_free_port())}
    done = subprocess.run(["sbatch", "--parsable", "--nodes=2", f"--output={out}", SCRIPT, *overrides], env=job_env,
                          capture_output=True, text=True, check=True)
    return done.stdout.strip().split(";")[0]


def job_state(env: dict, job: str) -> tuple[str, str]:
    shown = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    state, code = re.search(r"JobState=(\w+)", shown), re.search(r"ExitCode=(\d+:\d+)", shown)
    return (state[1] if state else "GONE"), (code[1] if code else "")


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if result := condition():
            return result
        time.sleep(2)
    raise TimeoutError(what)


def ray_processes(job: str) -> set[int]:
    """The Ray processes of SLURM job `job` (by the job id in their environment): other Ray
    instances on the machine, a test running beside this one, are not the job's."""
    found = subprocess.run(["pgrep", "-f", "raylet|gcs_server|ray start"], capture_output=True, text=True).stdout
    pids = set()
    for pid in found.split():
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:  # ended meanwhile
            continue
        if f"SLURM_JOB_ID={job}".encode() in environ:
            pids.add(int(pid))
    return pids


@needs_slurm
def test_the_sbatch_script_trains_on_two_nodes_and_scancel_stops_ray(slurm, tiny_model_dir, arithmetic_files,
                                                                    tmp_path):
    overrides = run_overrides(tiny_model_dir, arithmetic_files, tmp_path / "run", 64, 8) + [
        "trainer.n_gpus_per_node=1", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "trainer.logger=[console,jsonl]", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "trainer.final_model_dir=null"]
    out = tmp_path / "job.out"
    job = submit(slurm, out, overrides + ["trainer.total_training_steps=2"])
    wait_for(lambda: job_state(slurm, job)[0] not in ("PENDING", "RUNNING", "COMPLETING"), 600, f"job {job} ran on")
    log = out.read_text()
    assert job_state(slurm, job) == ("COMPLETED", "0:0"), log[-4000:]
    assert "Ray cluster up: 2 node(s)" in log and "(n1 n2)" in log
    placed = re.search(r"Ranks on Ray nodes: 0 on (\w+) .*, 1 on (\w+) ", log)
    assert placed and placed[1] != placed[2], log[-4000:]
    assert [json.loads(line)["step"] for line in open(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
    wait_for(lambda: not ray_processes(job), 60, "Ray processes left after the job")

    # The driver's exit code is the job's (2: bad input).
    job = submit(slurm, tmp_path / "bad.out", overrides + ["data.train_batch_size=3"])
    wait_for(lambda: job_state(slurm, job)[0] not in ("PENDING", "RUNNING", "COMPLETING"), 300, f"job {job} ran on")
    assert job_state(slurm, job) == ("FAILED", "2:0")
    assert "error: actor_rollout_ref.actor.ppo_mini_batch_size (4) is larger" in (tmp_path / "bad.out").read_text()

    # scancel mid-run: Ray stops on both nodes, the checkpoints already written stay whole.
    run2 = tmp_path / "run2"
    out2 = tmp_path / "job2.out"
    job = submit(slurm, out2, [o.replace(str(tmp_path / "run"), str(run2)) for o in overrides]
                 + ["trainer.total_training_steps=50", "trainer.save_freq=1"])
    wait_for(lambda: out2.exists() and "step 1:" in out2.read_text(), 600, "step 1 of the second job")
    assert ray_processes(job), "the running job's Ray processes are not found"
    subprocess.run(["scancel", job], env=slurm, check=True)
    wait_for(lambda: job_state(slurm, job)[0] in ("CANCELLED", "GONE"), 120, f"job {job} cancelled")
    wait_for(lambda: not ray_processes(job), 90, "Ray processes left after scancel")
    steps = sorted(int(p.name.split("_")[-1]) for p in run2.glob("global_step_*"))
    assert steps and steps[0] == 1
    latest = int((run2 / "latest_checkpointed_iteration.txt").read_text())
    assert latest in steps and (run2 / f"global_step_{latest}" / "trainer_state.json").exists()


def test_dry_run_names_every_node_in_its_own_srun():
    done = subprocess.run(["bash", SCRIPT, "--dry-run", "trainer.total_epochs=2"], capture_output=True, text=True,
                          env={**os.environ, "SLURM_JOB_NODELIST": "gpu-a,gpu-b,gpu-c", "GPUS_PER_NODE": "8"})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    starts = [line for line in lines if "ray start" in line]
    assert [re.search(r" -w (\S+) ", line)[1] for line in starts] == ["gpu-a", "gpu-b", "gpu-c"]
    assert "--head" in starts[0] and all("--address=HEAD_IP:6379" in line for line in starts[1:])
    assert lines[-1].strip() == ("python -m hybrid_rl.main trainer.placement_strategy=STRICT_SPREAD "
                                "trainer.total_epochs=2 trainer.nnodes=3 trainer.n_gpus_per_node=8")
