"""Turn a dense Llama/Mistral-shaped causal LM into a Mixtral mixture-of-experts model by sparse
upcycling (Komatsuzaki et al., 2022): every expert of a layer starts as a copy of that layer's
MLP, and the router starts small and random. The top-k routing weights sum to one, so the new
model computes exactly what the dense one did until training makes the experts differ.

    python tools/upcycle_moe.py --out ~/models/smollm2-4x --experts 4 --top-k 2

Without --model the default SmolLM2-135M-Instruct is upcycled. The folder loads in transformers
and vLLM, and trains on both engines (`megatron.expert_model_parallel_size` splits its experts).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def upcycle(model_path: str, out: Path, experts: int, top_k: int, router_std: float, seed: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, MixtralConfig, MixtralForCausalLM

    from hybrid_rl.export import write_folder

    dense = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    config = dense.config
    if config.model_type not in ("llama", "mistral") or getattr(config, "mlp_bias", False):
        raise SystemExit(f"{model_path} is a {config.model_type} model; upcycling takes Llama- or Mistral-shaped "
                         "ones (gated SiLU MLP without biases).")
    if not 1 <= top_k <= experts:
        raise SystemExit(f"--top-k {top_k} must be between 1 and --experts ({experts}).")
    rope = dict(getattr(config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": config.rope_theta})
    moe_config = MixtralConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=getattr(config, "head_dim", None),
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
        rope_parameters=rope, tie_word_embeddings=config.tie_word_embeddings, sliding_window=None,
        num_local_experts=experts, num_experts_per_tok=top_k, bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    torch.manual_seed(seed)
    moe = MixtralForCausalLM(moe_config)
    state = dense.state_dict()
    with torch.no_grad():
        for name, tensor in moe.state_dict().items():
            if ".mlp.experts.gate_up_proj" in name:  # [experts, 2 x inner, hidden]: gate over up
                mlp = name.replace("experts.gate_up_proj", "")
                tensor.copy_(torch.cat([state[f"{mlp}gate_proj.weight"], state[f"{mlp}up_proj.weight"]]).expand_as(tensor))
            elif ".mlp.experts.down_proj" in name:
                tensor.copy_(state[name.replace("experts.down_proj", "down_proj.weight")].expand_as(tensor))
            elif ".mlp.gate.weight" in name:  # the router
                tensor.normal_(0.0, router_std)
            else:
                tensor.copy_(state[name])

    def write(tmp: Path) -> None:
        moe.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(model_path).save_pretrained(tmp)
        try:
            GenerationConfig.from_pretrained(model_path).save_pretrained(tmp)
        except OSError:  # the dense folder has none
            pass

    write_folder(out, write, overwrite=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="dense model folder or .gguf (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--out", type=Path, required=True, help="a new folder")
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--router-std", type=float, default=0.02, help="the router's initial weights' std")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from hybrid_rl.models import resolve_model_path

    try:
        upcycle(resolve_model_path(args.model, key="--model"), args.out.expanduser().absolute(), args.experts,
                args.top_k, args.router_std, args.seed)
    except FileExistsError:
        raise SystemExit(f"error: {args.out} already exists; choose another --out or delete it.") from None
    print(f"wrote {args.out} ({args.experts} experts, top {args.top_k})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
