#!/usr/bin/env python
"""Sample and label responses, and train a reward model on them (`hybrid-rl-reward-model` once
installed; `python tools/train_reward_model.py --help` in a checkout)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hybrid_rl.rewards.training import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
