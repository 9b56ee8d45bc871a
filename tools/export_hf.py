#!/usr/bin/env python
"""Export a hybrid-rl checkpoint as a Hugging Face model folder (`hybrid-rl-export` once installed;
`python tools/export_hf.py --help` in a checkout)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hybrid_rl.export import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
