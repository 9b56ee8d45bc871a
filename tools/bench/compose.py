#!/usr/bin/env python
"""What composing and validating a config costs: `config_keys.compose_config` (each YAML file
parsed once per process) against Hydra's plain compose of the same tree (every file parsed on
every compose), and `validate_config`, for both trainer configs.

    python tools/bench/compose.py [--repeats 20] [--json out.json]

Each config name is timed in a fresh process, after one compose that fills the caches; the
figures are the median, min and max over the repeats, in seconds. The command line composes
once per run (this is not its start-up time); the tests and tools compose hundreds of configs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import common

OVERRIDES = ["actor_rollout_ref.actor.optim.lr=1e-3", "algorithm.adv_estimator=grpo"]


def _stats(seconds: list[float]) -> dict:
    return {"median_s": round(statistics.median(seconds), 4), "min_s": round(min(seconds), 4),
            "max_s": round(max(seconds), 4)}


def time_config(config_name: str, repeats: int) -> dict:
    from hydra import compose, initialize_config_dir

    from hybrid_rl.config import resolve_config, validate_config
    from hybrid_rl.config_keys import CONF_DIR, compose_config

    def hydra_plain():
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return resolve_config(compose(config_name=config_name, overrides=OVERRIDES))

    cfg = compose_config(OVERRIDES, config_name)
    cases = {"hydra_plain_compose": hydra_plain,
             "compose_config": lambda: compose_config(OVERRIDES, config_name),
             "validate_config": lambda: validate_config(cfg.copy())}
    out = {}
    for name, fn in cases.items():
        fn()  # warm: imports, and the parsed files
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - start)
        out[name] = _stats(seconds)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result = common.header({"repeats": args.repeats, "overrides": OVERRIDES}, packages=("hydra-core", "omegaconf"))
    for config_name in ("ppo_trainer", "ppo_megatron_trainer"):
        result[config_name] = common.run_isolated(time_config, config_name, args.repeats)
        print(config_name, result[config_name])
    common.write_json(args.json, result)


if __name__ == "__main__":
    main()
