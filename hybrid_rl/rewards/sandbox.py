"""Run untrusted Python (the policy's code) in a sandbox: bubblewrap namespaces plus resource limits.

Each run gets a fresh scratch directory as its only writable place, no network (a network
namespace with no interfaces up), its own PID namespace (when the run ends, is killed or times
out, every process it started dies with it), the whole filesystem read-only, a clean environment,
and ``prlimit`` limits set inside the namespace: address space (``memory_mb``), CPU seconds,
processes (``max_processes``, which stops fork bombs), file size and open files. A wall-clock
timeout kills it. Output goes to files in the scratch directory, so a program that prints forever
fills at most the file-size limit.

Root is exempt from process limits whatever the namespace (the kernel checks the global uid), so
when the trainer runs as root the sandbox runs as uid/gid 65534 (``nobody``), and the interpreter
must be one that uid can run (``python`` picks one at start: ours, else the system's).

Needs bubblewrap (``bwrap``, Debian/Ubuntu package ``bubblewrap``) and unprivileged user
namespaces; :meth:`Sandbox.start` checks both once and says what to install or enable.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

__all__ = ["ExecResult", "Sandbox", "SandboxUnavailable"]

NOBODY = 65534
_WORKDIR = "/tmp/work"  # where the scratch directory appears inside the sandbox


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run on this machine (bubblewrap or user namespaces missing)."""


@dataclass
class ExecResult:
    """``status``: ok (exit 0), error (non-zero exit or killed by a limit), timeout (wall clock)."""

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float


class Sandbox:
    def __init__(self, timeout_s: float = 10.0, memory_mb: int = 1024, max_processes: int = 32,
                 max_output_mb: int = 16, workers: int | None = None, python: str | None = None):
        if timeout_s <= 0 or memory_mb <= 0 or max_processes <= 0 or max_output_mb <= 0:
            raise ValueError("reward.sandbox: timeout_s, memory_mb, max_processes and max_output_mb must be positive")
        self.timeout_s = float(timeout_s)
        self.memory_mb = int(memory_mb)
        self.max_processes = int(max_processes)
        self.max_output_mb = int(max_output_mb)
        self.workers = int(workers or os.cpu_count() or 1)
        self.requested_python = python
        self.python: str | None = None
        self.as_nobody = os.geteuid() == 0
        self._pool: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ start
    def start(self) -> "Sandbox":
        """Find bwrap and an interpreter the sandbox user can run; raise SandboxUnavailable if not."""
        if shutil.which("bwrap") is None:
            raise SandboxUnavailable(
                "the code sandbox needs bubblewrap (bwrap), which is not installed: apt-get install bubblewrap "
                "(Debian/Ubuntu), dnf install bubblewrap (Fedora), or bash tools/install.sh --sandbox.")
        candidates = [self.requested_python] if self.requested_python else [sys.executable, "/usr/bin/python3"]
        tried = []
        for python in dict.fromkeys(c for c in candidates if c):
            result = self._run_once(python, "print(6 * 7)", stdin="")
            if result.status == "ok" and result.stdout.strip() == "42":
                self.python = python
                return self
            tried.append(f"{python}: {(result.stderr.strip() or result.status)[-300:]}")
        user = " as uid 65534 (the trainer runs as root, which process limits do not bind)" if self.as_nobody else ""
        raise SandboxUnavailable(
            f"the code sandbox could not run Python{user}. Tried: " + "; ".join(tried) + ". If bwrap says "
            "'No permissions to create new namespace', enable unprivileged user namespaces (sysctl "
            "kernel.unprivileged_userns_clone=1, or on Ubuntu 24.04 kernel.apparmor_restrict_unprivileged_userns=0); "
            "if Python cannot be executed, set reward.sandbox.python to an interpreter that user can run.")

    # -------------------------------------------------------------------- run
    def run(self, code: str, stdin: str = "") -> ExecResult:
        """Run ``code`` (Python source) with ``stdin``; never raises for what the code does."""
        if self.python is None:
            raise RuntimeError("call Sandbox.start() first")
        return self._run_once(self.python, code, stdin)

    def run_many(self, jobs: list[tuple[str, str]]) -> list[ExecResult]:
        """``[(code, stdin)]`` run ``workers`` at a time, results in order."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="sandbox")
        return list(self._pool.map(lambda job: self.run(*job), jobs))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_pool"] = None
        return state

    # ---------------------------------------------------------------- helpers
    def _command(self, python: str, scratch: str) -> list[str]:
        limits = [f"--as={self.memory_mb << 20}", f"--cpu={int(self.timeout_s) + 1}",
                  f"--nproc={self.max_processes}", f"--fsize={self.max_output_mb << 20}", "--nofile=256",
                  "--core=0"]
        return ["bwrap", "--unshare-user", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
                "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
                "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
                "--bind", scratch, _WORKDIR, "--chdir", _WORKDIR, "--clearenv",
                "--setenv", "HOME", _WORKDIR, "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin",
                "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
                # prlimit inside the namespaces: the process limit then counts this sandbox's processes only.
                "--", "prlimit", *limits, "--", python, "-I", "main.py"]

    def _run_once(self, python: str, code: str, stdin: str) -> ExecResult:
        scratch = tempfile.mkdtemp(prefix="hybrid_rl_sandbox_")
        try:
            with open(os.path.join(scratch, "main.py"), "w") as f:
                f.write(code)
            with open(os.path.join(scratch, "stdin"), "w") as f:
                f.write(stdin)
            owner = {}
            if self.as_nobody:
                os.chown(scratch, NOBODY, NOBODY)
                owner = dict(user=NOBODY, group=NOBODY, extra_groups=[])
            start = time.monotonic()
            with open(os.path.join(scratch, "stdin")) as fin, open(os.path.join(scratch, ".out"), "wb") as fout, \
                    open(os.path.join(scratch, ".err"), "wb") as ferr:
                proc = subprocess.Popen(self._command(python, scratch), stdin=fin, stdout=fout, stderr=ferr,
                                        start_new_session=True, **owner)
                try:
                    returncode = proc.wait(timeout=self.timeout_s)
                    status = "ok" if returncode == 0 else "error"
                except subprocess.TimeoutExpired:
                    # bwrap's death ends the PID namespace, and with it every process the code started.
                    os.killpg(proc.pid, 9)
                    proc.wait()
                    returncode, status = None, "timeout"
            return ExecResult(status, returncode, _read_head(os.path.join(scratch, ".out")),
                              _read_head(os.path.join(scratch, ".err")), time.monotonic() - start)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def _read_head(path: str, limit: int = 1 << 20) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")
