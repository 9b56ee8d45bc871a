#!/usr/bin/env python
"""Export a hybrid-rl checkpoint as a Hugging Face model folder (safetensors).

    python tools/export_hf.py checkpoints/my_run exported/my_run
    python tools/export_hf.py checkpoints/my_run/global_step_40 exported/critic40 --role critic --dtype bfloat16

CHECKPOINT is a run folder (trainer.default_local_dir; its latest checkpoint is exported) or one of
its global_step_<N> folders. OUT_DIR gets config.json, model.safetensors, the tokenizer files, the
chat template and generation_config.json, and loads with transformers' from_pretrained or vLLM.
Only the model weights are read; the optimizer state is left on disk.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hybrid_rl.export import ROLES, export_checkpoint, resolve_step_folder  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="run folder or global_step_<N> folder")
    ap.add_argument("out_dir", help="folder to write (must not exist or be empty, unless --overwrite)")
    ap.add_argument("--role", choices=ROLES, default="actor", help="actor (policy) or critic (value model)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                    help="dtype of the saved weights")
    ap.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it already exists")
    args = ap.parse_args(argv)

    try:
        step = resolve_step_folder(args.checkpoint)
        out = export_checkpoint(args.checkpoint, args.out_dir, role=args.role, dtype=args.dtype,
                                overwrite=args.overwrite)
    except (ValueError, OSError) as exc:  # clear messages from hybrid_rl.export; no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"exported {args.role} of {step} ({args.dtype}) to {out}:")
    for name in sorted(os.listdir(out)):
        print(f"  {name}  ({os.path.getsize(os.path.join(out, name)):,} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
