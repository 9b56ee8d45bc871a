"""Shared by the data-preparation scripts: read a source split from a local file or the hub, write
rows in verl's schema."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from hybrid_rl.data.arithmetic import write_rows  # noqa: E402,F401  (re-exported for the scripts)
from hybrid_rl.data.dataset import read_rows  # noqa: E402


def source_rows(local: str | None, repo_id: str, hub_file: str) -> list[dict]:
    """The rows of a local parquet / JSON Lines file, or else of `hub_file` in the hub dataset
    `repo_id` (downloaded once into the Hugging Face cache; needs the network)."""
    if local:
        return read_rows(os.path.expanduser(local))
    from huggingface_hub import hf_hub_download

    try:
        path = hf_hub_download(repo_id, hub_file, repo_type="dataset")
    except Exception as exc:  # offline, a proxy, a moved file: all end here
        raise SystemExit(f"error: could not download {hub_file} of the hub dataset {repo_id} ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0]}). Without the network, download it elsewhere and pass the "
                         "local file (--train-file / --test-file).") from None
    return read_rows(path)
