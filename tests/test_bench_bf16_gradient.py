"""tools/bench/bf16_gradient.py on a tiny model: it samples rollouts, differentiates the same loss
with and without bf16 autocast, and reports what the two gradients are."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bf16_gradient_bench_compares_the_two_gradients(tiny_model_dir, tmp_path):
    out = tmp_path / "bf16.json"
    subprocess.run([sys.executable, os.path.join(REPO, "tools", "bench", "bf16_gradient.py"), "--model",
                    tiny_model_dir, "--prompts", "2", "--responses", "2", "--json", str(out)],
                   check=True, capture_output=True, cwd=REPO, timeout=300)
    result = json.loads(out.read_text())
    norms, losses = result["grad_norm"], result["loss"]
    assert norms["float32"] > 0 and norms["bf16_autocast"] > 0
    # Same batch and loss, only the precision differs: close, and not bitwise equal.
    assert abs(losses["bf16_autocast"] - losses["float32"]) <= 0.05 * abs(losses["float32"]) + 1e-3
    assert norms["bf16_autocast"] != norms["float32"]
    names = [name for name, _ in result["lowest_cosines"]]
    assert len(names) == 5 and all(name.startswith(("model.", "lm_head")) for name in names)
    assert result["tokens"] > 2 * 2 and result["cpu"]["model"]
