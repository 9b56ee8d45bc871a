#!/usr/bin/env python
"""Convert a Hugging Face model folder into a Megatron dist-checkpoint of the model's weights, the
input of verl's `megatron.use_dist_checkpointing=true` + `megatron.dist_checkpointing_path` (the
flags of verl's scripts/converter_hf_to_mcore.py work too):

    python tools/convert_hf_to_mcore.py --hf-model-path ~/models/Qwen2.5-0.5B --output-path ~/mcore/qwen0.5b

One process on the CPU, with hybrid-rl's exact converter (fused QKV and gate/up, tied embeddings).
The checkpoint is resharded on load, so any tensor and pipeline layout of the trainer reads it.
Its names are those of megatron's Transformer Engine layer spec (the local spec maps its norms
onto them), which verl's converter also writes; a file written by verl's converter has not been
loaded here (that converter needs Transformer Engine).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf-model-path", "--hf_model_path",
                    help="Hugging Face model folder or .gguf file (default: the default SmolLM2-135M-Instruct)")
    ap.add_argument("--output-path", "--output_path", required=True, help="an empty or new folder")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="of the saved weights (fp32: exactly the folder's; bf16: half the size, as verl's)")
    args = ap.parse_args(argv)
    output = os.path.abspath(os.path.expanduser(args.output_path))
    if os.path.isdir(output) and os.listdir(output):
        ap.error(f"--output-path {output} is not empty; pass a new or empty folder.")

    import torch
    import torch.distributed as dist

    from hybrid_rl.config_keys import compose_config
    from hybrid_rl.engines import ModelSpec, build_engine
    from hybrid_rl.engines.megatron import model as mmodel
    from hybrid_rl.models import resolve_model_path

    path = resolve_model_path(args.hf_model_path)
    cfg = compose_config([f"actor_rollout_ref.model.path={path}", f"actor_rollout_ref.ref.megatron.dtype={args.dtype}",
                          "actor_rollout_ref.ref.strategy=megatron"], config_name="ppo_megatron_trainer")
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'init')}", rank=0, world_size=1)
        try:
            engine = build_engine(ModelSpec("ref", path, cfg.actor_rollout_ref.model), cfg.actor_rollout_ref.ref,
                                  torch.device("cpu"))
            with mmodel.device_layer(engine.device):
                mmodel.save_dist_weights(engine.models, output)
            params = engine.num_params()
        finally:
            dist.destroy_process_group()
    print(f"wrote {output} ({args.dtype}, {params:,} parameters)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
