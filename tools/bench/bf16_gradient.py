#!/usr/bin/env python
"""How far a bf16-autocast gradient is from the float32 one, on real rollouts or on random tokens.

    python tools/bench/bf16_gradient.py [--prompts 16] [--responses 4] [--random-tokens] [--model DIR]
        [--json out.json]

Plain `transformers` (none of our engines): the model samples `--responses` answers of up to 24
tokens to each of `--prompts` arithmetic problems (`make_arithmetic_rows`, chat template), or with
`--random-tokens` the prompts and responses are uniform random token ids of the same shape. One
policy-gradient loss, -mean(advantage x log p) over the response tokens with random advantages,
is differentiated twice over the same batch: without autocast and under CPU bf16 autocast (what
`dtype: auto` picks on a CPU with bf16 instructions, over float32 weights). Printed: both losses
and gradient norms, and the parameters whose two gradients have the lowest cosine similarity.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def rollout_batch(model, tokenizer, prompts: int, responses: int, random_tokens: bool, seed: int):
    """(input_ids, attention_mask, prompt_len): left-padded prompts, sampled responses cut after EOS."""
    import torch

    from hybrid_rl.data import make_arithmetic_rows

    rows = make_arithmetic_rows(prompts, seed=seed, split="test")
    texts = [tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=True, temperature=1.0, max_new_tokens=24,
                             num_return_sequences=responses, pad_token_id=tokenizer.pad_token_id)
    prompt_len = enc["input_ids"].shape[1]
    response = out[:, prompt_len:]
    is_eos = (response == tokenizer.eos_token_id).long()
    response_mask = (is_eos.cumsum(1) - is_eos == 0).long()  # up to and including the first EOS
    attention_mask = torch.cat([enc["attention_mask"].repeat_interleave(responses, 0), response_mask], 1)
    if random_tokens:
        g = torch.Generator().manual_seed(seed)
        out = torch.randint(100, model.config.vocab_size, out.shape, generator=g)
    return out, attention_mask, prompt_len


def gradients(model, input_ids, attention_mask, prompt_len, advantages, autocast: bool):
    import torch

    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=input_ids, attention_mask=attention_mask,
                       position_ids=(attention_mask.cumsum(1) - 1).clamp_min(0)).logits
    response, mask = input_ids[:, prompt_len:], attention_mask[:, prompt_len:]
    log_probs = torch.log_softmax(logits[:, prompt_len - 1:-1].float(), -1).gather(-1, response[..., None]).squeeze(-1)
    loss = -(log_probs * advantages * mask).sum() / mask.sum()
    loss.backward()
    return float(loss), {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--responses", type=int, default=4)
    ap.add_argument("--random-tokens", action="store_true", help="random token ids instead of the sampled rollouts")
    ap.add_argument("--model", help="a Hugging Face folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybrid_rl.models import resolve_model_path

    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    input_ids, attention_mask, prompt_len = rollout_batch(model, tokenizer, args.prompts, args.responses,
                                                          args.random_tokens, args.seed)
    advantages = torch.randn(input_ids.shape[0], 1, generator=torch.Generator().manual_seed(args.seed))
    loss32, g32 = gradients(model, input_ids, attention_mask, prompt_len, advantages, autocast=False)
    loss16, g16 = gradients(model, input_ids, attention_mask, prompt_len, advantages, autocast=True)
    norm = lambda grads: float(torch.sqrt(sum((g ** 2).sum() for g in grads.values())))  # noqa: E731
    cosines = sorted((float(torch.nn.functional.cosine_similarity(g32[n].flatten(), g16[n].flatten(), 0)), n)
                     for n in g32)
    summary = {"tokens": int(attention_mask.sum()), "loss": {"float32": loss32, "bf16_autocast": loss16},
               "grad_norm": {"float32": norm(g32), "bf16_autocast": norm(g16)},
               "lowest_cosines": [[n, round(c, 4)] for c, n in cosines[:5]]}
    print(f"{args.prompts} x {args.responses} {'random tokens' if args.random_tokens else 'rollouts'}, "
          f"{summary['tokens']} tokens: loss {loss32:.6f} (float32) / {loss16:.6f} (bf16); grad norm "
          f"{summary['grad_norm']['float32']:.4f} / {summary['grad_norm']['bf16_autocast']:.4f}")
    print("lowest cosine similarity:", ", ".join(f"{n} {c:.3f}" for c, n in cosines[:5]))
    common.write_json(args.json, {**common.header(vars(args), packages=("torch", "transformers")), **summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
