"""The default job as a new user starts it (`python -m hybrid_rl.main`, default model and data),
cut to one short step: a quiet start, no line repeated per tensor or layer, a closing summary and
a final model that transformers loads."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter

import pytest

from hybrid_rl.main import REPO_ROOT

pytestmark = pytest.mark.slow


def normalised(line: str) -> str:
    """A log line with its numbers, hex ids and quoted names blanked, so per-tensor and per-layer
    lines (which differ only there) compare equal."""
    line = re.sub(r"\x1b\[[0-9;]*m", "", line)
    line = re.sub(r"'[^']*'|\"[^\"]*\"", "'_'", line)
    return re.sub(r"0x[0-9a-f]+|\d+", "#", line).strip()


def test_one_step_default_run_is_quiet_and_saves_its_model(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "hybrid_rl.main", f"trainer.default_local_dir={run_dir}",
           "trainer.total_training_steps=1", "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
           "data.val_max_samples=8", "trainer.progress_bar=false"]
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    lines = [line for line in output.splitlines() if line.strip()]

    repeated = {line: n for line, n in Counter(map(normalised, lines)).items() if n > 3}
    assert not repeated, f"lines repeated per tensor or layer: {repeated}"
    warnings = [line for line in lines if re.search(r"warn", line, re.IGNORECASE)]
    assert len(warnings) <= 15, "\n".join(warnings)
    assert any(line.startswith("compute dtype ") for line in lines), output[-3000:]

    summary = lines[lines.index(next(line for line in lines if line.startswith("Run summary:"))):]
    assert summary[0].startswith("Run summary: finished 1 steps"), summary
    assert any("time per step:" in line for line in summary)
    assert any("validation score (val/score/mean):" in line for line in summary)
    final_model = run_dir / "final_model"
    assert any(f"final model: {final_model}" in line for line in summary), summary

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(final_model)
    model = AutoModelForCausalLM.from_pretrained(final_model)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids.shape[1]
