"""Mixture-of-experts models on the Megatron engine with expert parallelism (EP=2 over two gloo
ranks, each holding half of every layer's experts) against the FSDP engine on the same two ranks,
model, batches and seed: equal log-probs, loss, grad norm and weight update; the weights it gives
back are transformers' own (experts stacked) to the bit; a resumed engine continues exactly. With
context parallelism as well (CP=2, EP=2), or tensor and sequence parallelism (TP=2, EP=1 or 2),
equal to one FSDP process on the same rows."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from hybrid_rl.engines import Output
from hybrid_rl.export import ExportError, export_checkpoint
from tests.engine_helpers import (
    actor_config, export_step_folder, loss_fn, make_engine, rollout_batch, step, two_rank_results, weights,
)

pytestmark = pytest.mark.slow
FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")
EXPERT_PARALLEL = ("actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",)
# B drawn too (not zero), so that the adapters change the outputs from the first step.
EXPERT_LORA = ("actor_rollout_ref.model.lora.rank=4", "actor_rollout_ref.model.lora.lora_B_init_method=normal")


def rank_batch(seed: int):
    """Each data-parallel rank's own rows: a mini-batch of 4 prompts x 2 samples over two ranks."""
    return rollout_batch(seed + 100 * dist.get_rank(), rows=4)


def train(engine, cfg, seed: int) -> dict:
    return engine.update(rank_batch(seed), cfg.actor_rollout_ref.actor, rollout_n=2, seed=seed,
                         output=Output.LOG_PROBS_ENTROPY, temperature=0.7, loss_fn=loss_fn)


def run(cfg, model_dir: str, out_dir: str) -> dict:
    engine = make_engine(cfg, model_dir)
    infer = engine.infer(rank_batch(1), Output.LOG_PROBS_ENTROPY, 0.7, 3, None)
    before = weights(engine)
    first, after = train(engine, cfg, 1), weights(engine)
    engine.save_checkpoint(os.path.join(out_dir, "ckpt"))
    second = train(engine, cfg, 2)
    resumed = make_engine(cfg, model_dir)
    resumed.load_checkpoint(os.path.join(out_dir, "ckpt"))
    return {"infer": infer, "before": before, "first": first, "after": after, "second": second,
            "resumed": train(resumed, cfg, 2), "params": engine.num_params(), "dp": engine.dp_size}


# The optimizer settings of verl's Qwen3-MoE Megatron scripts (GPU-only: dropped on CPU) and one
# that applies here.
VERL_OPTIMIZER_OVERRIDES = tuple(f"+actor_rollout_ref.actor.optim.override_optimizer_config.{setting}" for setting in (
    "optimizer_cpu_offload=True", "optimizer_offload_fraction=1", "overlap_cpu_optimizer_d2h_h2d=True",
    "use_precision_aware_optimizer=True", "adam_eps=1e-7"))


def _rank_main(rank, world, init_file, model_dirs, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    for family, model_dir in model_dirs.items():
        for strategy in ("fsdp2", "megatron"):
            folder = os.path.join(out_dir, f"{family}_{strategy}")
            os.makedirs(folder, exist_ok=True)
            cfg = actor_config(strategy, extra=EXPERT_PARALLEL)
            results[family, strategy] = run(cfg, model_dir, folder)
    cfg = actor_config("megatron", extra=EXPERT_PARALLEL + VERL_OPTIMIZER_OVERRIDES)
    engine = make_engine(cfg, model_dirs["mixtral"])
    results["overrides"] = {"first": train(engine, cfg, 1), "adam_eps": engine.optimizer.config.adam_eps,
                            "offload": engine.optimizer.config.optimizer_cpu_offload}
    # Context parallelism too: both ranks hold every row (one data-parallel replica), each half
    # of every sequence and half of the experts.
    from megatron.core import parallel_state

    # Tensor parallelism with megatron's sequence parallelism (verl's default), the experts
    # whole on both ranks (EP=1) or split (EP=2).
    layouts = {"cp": dict(cp=2, extra=EXPERT_PARALLEL), "tp_ep1": dict(tp=2),
               "tp_ep2": dict(tp=2, extra=EXPERT_PARALLEL)}
    for name, layout in layouts.items():
        parallel_state.destroy_model_parallel()
        for family, model_dir in model_dirs.items():
            cfg = actor_config("megatron", **layout)
            engine = make_engine(cfg, model_dir)
            before = weights(engine)
            results[name, family] = {"infer": engine.infer(rollout_batch(1), Output.LOG_PROBS_ENTROPY, 0.7, 3, None),
                                     "first": step(engine, cfg, 1), "dp": engine.dp_size,
                                     "sequence_parallel": engine.config.sequence_parallel, "before": before,
                                     "after": weights(engine)}
            # LoRA (verl's model.lora.*) on the attention and every expert.
            extra = layout.get("extra", ()) + EXPERT_LORA
            cfg = actor_config("megatron", **{**layout, "extra": extra})
            engine = make_engine(cfg, model_dir)
            results[name, family]["lora"] = {
                "infer": engine.infer(rollout_batch(1), Output.LOG_PROBS_ENTROPY, 0.7, 3, None),
                "first": step(engine, cfg, 1), "after": weights(engine),
                "trained": sorted(name for name, _ in engine.per_tensor_weights(None, only_trained=True)),
                "checkpoint": os.path.join(out_dir, f"lora_{name}_{family}")}
            engine.save_checkpoint(results[name, family]["lora"]["checkpoint"])
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def expert_runs(tiny_moe_model_dirs, tmp_path_factory) -> list[dict]:
    return two_rank_results(_rank_main, tmp_path_factory.mktemp("megatron_experts"), tiny_moe_model_dirs)


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_parallel_megatron_matches_fsdp(expert_runs, family):
    for rank, runs in enumerate(expert_runs):
        fsdp, megatron = runs[family, "fsdp2"], runs[family, "megatron"]
        assert megatron["dp"] == fsdp["dp"] == 2  # expert parallelism leaves the data split alone
        mask = rollout_batch(1 + 100 * rank, rows=4)["response_mask"].bool()
        for key in ("log_probs", "entropy"):
            assert (megatron["infer"][key] - fsdp["infer"][key])[mask].abs().max() <= 1e-5
        # HF -> Megatron -> HF is exact, and the experts come back stacked as transformers holds them.
        assert set(megatron["before"]) == set(fsdp["before"])
        assert "model.layers.0.mlp.experts.gate_up_proj" in megatron["before"]
        assert all(torch.equal(megatron["before"][k], fsdp["before"][k]) for k in fsdp["before"])
        assert megatron["first"]["actor/loss"] == pytest.approx(fsdp["first"]["actor/loss"], rel=1e-4)
        assert megatron["first"]["actor/grad_norm"] == pytest.approx(fsdp["first"]["actor/grad_norm"], rel=1e-4)
        update = torch.cat([(megatron["after"][k] - megatron["before"][k]).flatten() for k in fsdp["after"]])
        expected = torch.cat([(fsdp["after"][k] - fsdp["before"][k]).flatten() for k in fsdp["after"]])
        assert (update - expected).norm() / expected.norm() <= 1e-3
        assert megatron["resumed"] == megatron["second"]
        assert megatron["params"] == fsdp["params"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", ["cp", "tp_ep1", "tp_ep2"])
def test_context_or_tensor_parallel_megatron_matches_one_fsdp_process(expert_runs, tiny_moe_model_dirs, family,
                                                                       layout):
    """CP=2 with EP=2, and TP=2 (sequence parallel) with EP=1 or 2, on two ranks against the FSDP
    engine on one process, the same rows."""
    cfg = actor_config("fsdp2")
    fsdp = make_engine(cfg, tiny_moe_model_dirs[family])
    expected_infer = fsdp.infer(rollout_batch(1), Output.LOG_PROBS_ENTROPY, 0.7, 3, None)
    expected = step(fsdp, cfg, 1)
    expected_after = weights(fsdp)
    mask = rollout_batch(1)["response_mask"].bool()
    for runs in expert_runs:
        result = runs[layout, family]
        assert result["dp"] == 1 and result["sequence_parallel"] == layout.startswith("tp")
        for key in ("log_probs", "entropy"):
            assert (result["infer"][key] - expected_infer[key])[mask].abs().max() <= 1e-5
        for key in ("actor/loss", "actor/grad_norm"):
            assert result["first"][key] == pytest.approx(expected[key], rel=1e-6)
        # Every weight, the experts' too (each TP rank runs them on its own tokens), moves as in one process.
        for name in expected_after:
            update = result["after"][name] - result["before"][name]
            expected_update = expected_after[name] - result["before"][name]
            assert (update - expected_update).norm() <= 1e-3 * expected_update.norm(), name


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_lora_is_the_same_in_every_layout(expert_runs, family):
    """LoRA on the attention and on every expert's linears (drawn from each layer's model-wide
    name, so the same in every layout): equal outputs and first update with CP=2 and EP=2, TP=2
    and EP=1, TP=2 and EP=2; the synced weights as trained are the adapted ones, experts included."""
    runs = [runs_of_rank[layout, family] for runs_of_rank in expert_runs for layout in ("cp", "tp_ep1", "tp_ep2")]
    mask = rollout_batch(1)["response_mask"].bool()
    reference = runs[0]["lora"]
    assert (reference["infer"]["log_probs"] - runs[0]["infer"]["log_probs"])[mask].abs().max() > 1e-3
    assert "model.layers.0.mlp.experts.down_proj" in reference["trained"]
    assert "model.layers.0.self_attn.q_proj.weight" in reference["trained"]
    assert not any("router" in name or "gate.weight" in name or "norm" in name for name in reference["trained"])
    for run in runs[1:]:
        lora = run["lora"]
        assert (lora["infer"]["log_probs"] - reference["infer"]["log_probs"])[mask].abs().max() <= 1e-5
        for key in ("actor/loss", "actor/grad_norm"):
            assert lora["first"][key] == pytest.approx(reference["first"][key], rel=1e-4)
        assert lora["trained"] == reference["trained"]


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_lora_checkpoints_export_merged(expert_runs, tiny_moe_model_dirs, family, tmp_path):
    """hybrid-rl-export of a LoRA checkpoint with the experts adapted (written under each layout)
    merges every expert's adapter into the stacked experts: the model the run held after its step.
    peft has no module to hold an expert's adapter, so --adapter-only is refused with the fix."""
    from transformers import AutoModelForCausalLM

    for layout in ("cp", "tp_ep1", "tp_ep2"):
        run = expert_runs[0][layout, family]["lora"]
        step_dir = export_step_folder(run["checkpoint"], tiny_moe_model_dirs[family], tmp_path / layout / "global_step_1")
        exported = export_checkpoint(str(step_dir), str(tmp_path / layout / "merged"))
        merged = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).state_dict()
        after = run["after"]
        assert all((merged[k] - after[k]).abs().max() <= 1e-6 for k in after)
        assert "model.layers.0.mlp.experts.gate_up_proj" in after
        with pytest.raises(ExportError, match="without --adapter-only"):
            export_checkpoint(str(step_dir), str(tmp_path / layout / "adapter"), adapter_only=True)


@pytest.mark.parametrize("ranks, ep, tp, expected", [
    (3, 3, 1, "expert_model_parallel_size=3 does not divide the model's 4 experts"),
    (3, 2, 1, r"expert_model_parallel_size \(2\) x pipeline_model_parallel_size \(1\) must divide the number of ranks \(3"),
    (2, 1, 2, "tensor_model_parallel_size=2 with sequence_parallel=false: megatron trains a mixture-of-experts "
              "model under tensor parallelism only with its sequence parallelism"),
])
def test_expert_layouts_the_model_cannot_take_are_refused_at_start(tiny_moe_model_dirs, ranks, ep, tp, expected):
    from hybrid_rl.config import ConfigError, check_model_limits, validate_config
    from hybrid_rl.main import compose_config

    cfg = validate_config(compose_config([
        f"trainer.n_gpus_per_node={ranks}", "trainer.device=cpu", "data.train_batch_size=6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=6", f"actor_rollout_ref.actor.megatron.expert_model_parallel_size={ep}",
        f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}",
        "actor_rollout_ref.actor.megatron.sequence_parallel=false"],
        config_name="ppo_megatron_trainer"))
    with pytest.raises(ConfigError, match=expected):
        check_model_limits(cfg, tiny_moe_model_dirs["mixtral"])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_converted_mixture_of_experts_checkpoint_reads_back_as_transformers_weights(tiny_moe_model_dirs, family,
                                                                                     tmp_path):
    """tools/convert_hf_to_mcore.py writes every layer's experts stacked; export reads them back
    into transformers' own layout and values, to the bit."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hybrid_rl.engines.megatron import convert
    from hybrid_rl.export import read_model_state
    from tests.test_megatron_dist_weights import convert as convert_to_mcore

    model_dir = tiny_moe_model_dirs[family]
    folder = convert_to_mcore(model_dir, str(tmp_path / "mcore"))
    state = convert.hf_state_from_dist_checkpoint(read_model_state(folder),
                                                  convert.Layout.from_hf_config(AutoConfig.from_pretrained(model_dir)))
    expected = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    assert set(state) == set(expected) - {"lm_head.weight"}  # tied to the embedding
    assert all(torch.equal(state[name], expected[name]) for name in state)


def test_verl_optimizer_overrides_apply_and_the_gpu_only_ones_are_dropped_on_cpu(expert_runs):
    for runs in expert_runs:
        overridden = runs["overrides"]
        assert overridden["adam_eps"] == 1e-7 and overridden["offload"] is False
        assert overridden["first"]["actor/loss"] == runs["mixtral", "megatron"]["first"]["actor/loss"]
        assert overridden["first"]["actor/grad_norm"] == runs["mixtral", "megatron"]["first"]["actor/grad_norm"]
