#!/usr/bin/env python
"""Score a model or checkpoint on RL data files (`hybrid-rl-evaluate` once installed; `--help`)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hybrid_rl.evaluate import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
