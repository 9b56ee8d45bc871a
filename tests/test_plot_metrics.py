"""tools/plot_metrics.py: several runs, metric patterns, labels."""

import json
import subprocess
import sys

from pathlib import Path

from hybrid_rl.main import REPO_ROOT


def write_run(folder, steps, offset):
    folder.mkdir()
    with open(folder / "metrics.jsonl", "w") as f:
        for step in range(1, steps + 1):
            row = {"step": step, "critic/score/mean": offset + step / 10, "actor/entropy": 1 - step / 20}
            if step % 5 == 0:
                row.update({"val-core/arithmetic/reward/mean@1": 0.3, "val-core/arithmetic/wide/reward/mean@1": 0.1})
            f.write(json.dumps(row) + "\n")
    return folder / "metrics.jsonl"


def test_plots_two_runs_with_labels_and_patterns(tmp_path):
    a, b = write_run(tmp_path / "a", 10, 0.0), write_run(tmp_path / "b", 8, 0.1)
    sys.path.insert(0, str(Path(REPO_ROOT) / "tools"))
    from plot_metrics import expand, read_run

    runs = [read_run(f"{a}:GRPO"), read_run(str(b))]
    assert [label for label, _ in runs] == ["GRPO", "b"]
    assert expand(["actor/entropy", "val-core/*"], runs) == [
        "actor/entropy", "val-core/arithmetic/reward/mean@1", "val-core/arithmetic/wide/reward/mean@1"]
    done = subprocess.run([sys.executable, "tools/plot_metrics.py", f"{a}:GRPO", str(b), "--metrics", "val-core/*",
                           "actor/entropy"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "a" / "metrics.png").stat().st_size > 1000
    missing = subprocess.run([sys.executable, "tools/plot_metrics.py", str(a), "--metrics", "nope/*", "-o",
                              str(tmp_path / "x.png")], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0 and "no metric matches" in missing.stderr
