#!/usr/bin/env python
"""What router replay R2 costs the FSDP engine: the old-log-prob pass that records each token's
experts and the update that imposes them, against the same passes without router replay.

    python tools/bench/router_replay.py --model <mixture-of-experts folder> [--rows 32] [--repeats 4]
                                        [--dtype bf16] [--json out.json]

The model is any folder the FSDP engine replays (e.g. `tools/upcycle_moe.py --out <folder>`). The
batch is `--rows` rows in pairs that share a prompt (96 prompt, up to 160 response columns, random
lengths), in micro-batches of 8 rows, one mini-batch of all rows, as a GRPO step's
`compute_log_prob` and `update_actor` run them. Each engine runs in its own process, one after the
other, twice each in turn (off, R2, off, R2); each pass is timed `--repeats` times, and the median
is reported per setting.
"""

from __future__ import annotations

import argparse
import statistics
import time

import common

MICRO_ROWS, PROMPT, RESPONSE = 8, 96, 160


def batch_of(rows: int, vocab: int):
    import torch

    from hybrid_rl.protocol import Batch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (rows, PROMPT + RESPONSE), generator=g)
    mask = torch.ones_like(ids)
    for r in range(rows):
        mask[r, :int(torch.randint(0, 30, (), generator=g))] = 0
        mask[r, PROMPT + int(torch.randint(20, RESPONSE, (), generator=g)):] = 0
    ids[1::2, :PROMPT], mask[1::2, :PROMPT] = ids[0::2, :PROMPT], mask[0::2, :PROMPT]
    ids = ids * mask
    return Batch(tensors={"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp_min(0),
                          "responses": ids[:, PROMPT:], "response_mask": mask[:, PROMPT:].float(),
                          "advantages": torch.randn(rows, RESPONSE, generator=g)})


def run(model: str, mode: str, rows: int, repeats: int, dtype: str) -> dict:
    import torch
    from transformers import AutoConfig

    from hybrid_rl.config_keys import compose_config
    from hybrid_rl.engines import ModelSpec, Output, build_engine
    from hybrid_rl.engines.base import ROUTES_KEY

    cfg = compose_config([f"actor_rollout_ref.actor.fsdp_config.dtype={dtype}",
                          f"actor_rollout_ref.actor.router_replay.mode={mode}",
                          f"actor_rollout_ref.actor.ppo_mini_batch_size={rows // 2}",
                          f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={MICRO_ROWS}",
                          "actor_rollout_ref.actor.use_dynamic_bsz=false"])
    actor = cfg.actor_rollout_ref.actor
    engine = build_engine(ModelSpec("actor", model, cfg.actor_rollout_ref.model, optim_cfg=actor.optim,
                                    total_steps=repeats), actor, torch.device("cpu"))
    batch = batch_of(rows, AutoConfig.from_pretrained(model).vocab_size)

    def loss_fn(out, micro, agg):
        loss = -(out["log_probs"] * micro["advantages"] * micro["response_mask"]).sum() / agg["global_num_tokens"]
        return loss, {"loss": float(loss.detach())}

    log_prob_s, update_s = [], []
    for step in range(repeats):
        part = batch.select(list(batch.tensors.keys()), non_tensor_keys=[])
        start = time.perf_counter()
        if mode == "R2":
            with engine.recording_routes():
                out = engine.infer(part, Output.LOG_PROBS, 1.0, MICRO_ROWS, None)
            part[ROUTES_KEY] = out[ROUTES_KEY]
        else:
            engine.infer(part, Output.LOG_PROBS, 1.0, MICRO_ROWS, None)
        log_prob_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        engine.update(part, actor, rollout_n=2, seed=step, output=Output.LOG_PROBS, temperature=1.0, loss_fn=loss_fn)
        update_s.append(time.perf_counter() - start)
    return {"log_prob_s": log_prob_s, "update_s": update_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--json")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"disabled": [], "R2": []}
    for mode in ("disabled", "R2") * 2:
        runs[mode].append(common.run_isolated(run, args.model, mode, args.rows, args.repeats, args.dtype))
    result = common.header(vars(args))
    for mode, results in runs.items():
        result[mode] = {key: statistics.median(x for r in results for x in r[key])
                        for key in ("log_prob_s", "update_s")}
        print(f"{mode}: old-log-prob pass {result[mode]['log_prob_s']:.2f} s, update {result[mode]['update_s']:.2f} s "
              "(medians)")
    common.write_json(args.json, result)


if __name__ == "__main__":
    main()
