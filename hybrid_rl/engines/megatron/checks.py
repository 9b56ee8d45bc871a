"""What a Megatron layout needs, checked before any worker starts (no megatron import here).

`check_roles` runs in the driver with the model's HF config: every role on `strategy=megatron`
gets its parallel sizes checked against the world size, the model's heads and layers, the
architectures the converter knows, the device, and what the engine computes; the engine checks
its own section again (`check_layout`) when it is built outside a run.
"""

from __future__ import annotations

from typing import Any

from hybrid_rl.config_keys import plain
from hybrid_rl.engines.megatron import convert
from hybrid_rl.engines.megatron.cpu import check_version
from hybrid_rl.engines.megatron.routing import check_replayable
from hybrid_rl.engines.routing import replay_mode
from hybrid_rl.models import tensor_parallel_sizes



def parallel_sizes(megatron_cfg: Any) -> tuple[int, int, int | None]:
    """(tensor, pipeline, virtual pipeline) sizes of a role's `megatron` section."""
    vpp = megatron_cfg.get("virtual_pipeline_model_parallel_size")
    return (int(megatron_cfg.tensor_model_parallel_size), int(megatron_cfg.pipeline_model_parallel_size),
            int(vpp) if vpp is not None and int(vpp) > 1 else None)


def expert_parallel_size(megatron_cfg: Any) -> int:
    """The role's `expert_model_parallel_size` (1 when unset)."""
    return int(megatron_cfg.get("expert_model_parallel_size") or 1)


def context_parallel_size(megatron_cfg: Any) -> int:
    """The role's `context_parallel_size` (1 when unset)."""
    return int(megatron_cfg.get("context_parallel_size") or 1)


def check_experts(section: str, megatron_cfg: Any, layout: convert.Layout, world: int, tp: int, pp: int,
                  pool: str) -> None:
    """Expert parallelism: a mixture-of-experts model, experts dealt evenly, whole groups of
    ranks; experts are never split over tensor-parallel ranks here. megatron trains a mixture of
    experts under tensor parallelism only with its sequence parallelism."""
    if layout.experts is not None and tp > 1 and not megatron_cfg.get("sequence_parallel", False):
        raise ValueError(f"{section}.tensor_model_parallel_size={tp} with sequence_parallel=false: megatron trains "
                         "a mixture-of-experts model under tensor parallelism only with its sequence parallelism; "
                         f"set {section}.sequence_parallel=true (verl's default).")
    ep, etp = expert_parallel_size(megatron_cfg), megatron_cfg.get("expert_tensor_parallel_size")
    if etp is not None and int(etp) != 1:
        raise ValueError(f"{section}.expert_tensor_parallel_size={etp}: this engine keeps each expert whole on one "
                         "rank (expert_tensor_parallel_size=1 or null); split the experts over ranks with "
                         "expert_model_parallel_size instead.")
    if ep < 1:
        raise ValueError(f"{section}.expert_model_parallel_size must be >= 1 (got {ep}).")
    if ep == 1:
        return
    if layout.experts is None:
        raise ValueError(f"{section}.expert_model_parallel_size={ep}: the model has no experts (not a mixture of "
                         "experts); set it to 1.")
    if layout.experts.count % ep:
        raise ValueError(f"{section}.expert_model_parallel_size={ep} does not divide the model's "
                         f"{layout.experts.count} experts: choose a divisor of {layout.experts.count}.")
    if world % (ep * pp):  # megatron's expert groups are EP x PP ranks (TP and CP are folded into them)
        raise ValueError(f"{section}.expert_model_parallel_size ({ep}) x pipeline_model_parallel_size ({pp}) must "
                         f"divide the number of ranks ({world}, {pool}.nnodes x {pool}.n_gpus_per_node).")


def check_layout(key: str, megatron_cfg: Any, layout: convert.Layout, world: int, pool: str = "trainer") -> None:
    """Refuse, naming the key and the fix, a layout this engine cannot run for this model on
    `world` ranks (`pool`.nnodes x `pool`.n_gpus_per_node)."""
    tp, pp, vpp = parallel_sizes(megatron_cfg)
    cp = context_parallel_size(megatron_cfg)
    section = f"{key}.megatron"
    if tp < 1 or pp < 1 or cp < 1:
        raise ValueError(f"{section}.tensor_model_parallel_size, pipeline_model_parallel_size and "
                         f"context_parallel_size must be >= 1 (got {tp}, {pp} and {cp}).")
    if world % (tp * pp * cp):
        sizes = f"tensor_model_parallel_size ({tp}) x pipeline_model_parallel_size ({pp})"
        if cp > 1:
            sizes += f" x context_parallel_size ({cp})"
        raise ValueError(f"{section}.{sizes} must divide the number of ranks ({world}, {pool}.nnodes x "
                         f"{pool}.n_gpus_per_node): change one of them.")
    # Fewer key/value heads than TP ranks is fine when each head's ranks are whole (megatron
    # gathers the fused qkv output then).
    valid = tensor_parallel_sizes(layout.heads, layout.groups)
    if tp not in valid:
        raise ValueError(f"{section}.tensor_model_parallel_size={tp} does not fit the model's {layout.heads} "
                         f"attention heads and {layout.groups} key/value heads: it must divide the attention "
                         f"heads and divide or be a multiple of the key/value heads (valid here: "
                         f"{', '.join(map(str, valid))}).")
    if vpp is not None and pp == 1:
        raise ValueError(f"{section}.virtual_pipeline_model_parallel_size={vpp} needs "
                         "pipeline_model_parallel_size > 1.")
    if layout.num_layers % (pp * (vpp or 1)):
        raise ValueError(f"{section}.pipeline_model_parallel_size={pp} x virtual_pipeline_model_parallel_size="
                         f"{vpp or 1} does not divide the model's {layout.num_layers} layers.")
    if layout.latent is not None:
        check_latent(section, megatron_cfg, tp)
    check_experts(section, megatron_cfg, layout, world, tp, pp, pool)
    check_dist_weights(key, megatron_cfg)


def check_latent(section: str, megatron_cfg: Any, tp: int) -> None:
    """Latent attention under TP: each rank projects its own part of the sequence to the latents
    (whole down projections), so megatron's sequence parallelism must be on."""
    if tp > 1 and not megatron_cfg.get("sequence_parallel", False):
        raise ValueError(f"{section}.tensor_model_parallel_size={tp} with sequence_parallel=false: the engine runs "
                         "latent attention under tensor parallelism only with megatron's sequence parallelism; set "
                         f"{section}.sequence_parallel=true (verl's default).")


def check_dist_weights(key: str, megatron_cfg: Any) -> None:
    """`use_dist_checkpointing` needs `dist_checkpointing_path` to hold a Megatron dist-checkpoint."""
    if not megatron_cfg.get("use_dist_checkpointing", False):
        return
    section, path = f"{key}.megatron", megatron_cfg.get("dist_checkpointing_path")
    fix = ("write one with `python tools/convert_hf_to_mcore.py --hf-model-path <model folder> --output-path "
           "<folder>`, or set use_dist_checkpointing=false to convert the Hugging Face folder at start")
    if not path:
        raise ValueError(f"{section}.use_dist_checkpointing=true needs {section}.dist_checkpointing_path: {fix}.")
    if not convert.is_dist_checkpoint(path):
        raise ValueError(f"{section}.dist_checkpointing_path={path} is not a Megatron dist-checkpoint (no megatron "
                         f"metadata.json there): {fix}.")


def frozen_routers(key: str, megatron_cfg: Any, layout: convert.Layout) -> bool:
    """verl's `override_mcore_model_config`, of which verl reads `moe_config.freeze_moe_router`
    only: whether a mixture-of-experts model's routers (and Qwen2-MoE's shared-expert gates) stay
    as loaded while the rest trains."""
    section = f"{key}.megatron.override_mcore_model_config"
    override = plain(megatron_cfg.get("override_mcore_model_config")) or {}
    moe = override.get("moe_config") or {}
    unknown = sorted(set(override) - {"moe_config"}) + sorted(f"moe_config.{name}" for name in
                                                                set(moe) - {"freeze_moe_router"})
    if unknown:
        raise ValueError(f"{section} sets {', '.join(unknown)}: verl reads only moe_config.freeze_moe_router there, "
                         "and so does this engine; set model settings in override_transformer_config.")
    freeze = bool(moe.get("freeze_moe_router", False))
    if freeze and layout.experts is None:
        raise ValueError(f"{section}.moe_config.freeze_moe_router=true, but the model has no mixture-of-experts "
                         "routers to freeze; remove it.")
    return freeze


def virtual_stages_from_layers_per_stage(key: str, megatron_cfg: Any, num_layers: int) -> int | None:
    """verl 0.2's `num_layers_per_virtual_pipeline_stage` (megatron-LM's argument of that name,
    which verl 0.2 declared but never read) as the virtual pipeline size it implies: each pipeline
    stage's layers / this, as megatron-LM computes it. None when it is unset."""
    per_stage = megatron_cfg.get("num_layers_per_virtual_pipeline_stage")
    if per_stage is None:
        return None
    section = f"{key}.megatron"
    pp = int(megatron_cfg.pipeline_model_parallel_size)
    if int(per_stage) < 1:
        raise ValueError(f"{section}.num_layers_per_virtual_pipeline_stage must be >= 1 (got {per_stage}).")
    if pp < 2:
        raise ValueError(f"{section}.num_layers_per_virtual_pipeline_stage={per_stage} splits each pipeline stage "
                         "into virtual stages, which needs pipeline_model_parallel_size > 1 (it is 1): raise it, or "
                         "drop the key.")
    if num_layers % pp:
        raise ValueError(f"{section}.pipeline_model_parallel_size={pp} does not divide the model's {num_layers} "
                         "layers.")
    stage_layers = num_layers // pp
    if stage_layers % int(per_stage):
        valid = [n for n in range(1, stage_layers + 1) if stage_layers % n == 0]
        raise ValueError(f"{section}.num_layers_per_virtual_pipeline_stage={per_stage} does not divide the "
                         f"{stage_layers} layers of each of the {pp} pipeline stages (valid here: "
                         f"{', '.join(map(str, valid))}).")
    vpp = stage_layers // int(per_stage)
    given = megatron_cfg.get("virtual_pipeline_model_parallel_size")
    if given is not None and int(given) != vpp:
        raise ValueError(f"{section}.num_layers_per_virtual_pipeline_stage={per_stage} means "
                         f"virtual_pipeline_model_parallel_size={vpp} for this model ({num_layers} layers, {pp} "
                         f"pipeline stages), but virtual_pipeline_model_parallel_size={given} is set: keep one.")
    return vpp


def adopt_layers_per_virtual_stage(cfg: Any, hf_config: Any, roles: dict[str, bool],
                                   role_configs: dict[str, Any] | None = None) -> None:
    """Each Megatron role's `num_layers_per_virtual_pipeline_stage` set as the virtual pipeline size
    it implies for its model. The reference, whose virtual pipeline size follows the actor's in
    verl's tree, follows the actor's layers per virtual stage too unless it sets either itself."""
    megatron = [key for key, used in roles.items() if used and _section(cfg, key).strategy == "megatron"]
    actor, ref = cfg.actor_rollout_ref.actor.get("megatron"), cfg.actor_rollout_ref.ref.get("megatron")
    if (actor is not None and ref is not None and actor.get("num_layers_per_virtual_pipeline_stage") is not None
            and ref.get("num_layers_per_virtual_pipeline_stage") is None
            and ref.get("virtual_pipeline_model_parallel_size") is None):
        ref.num_layers_per_virtual_pipeline_stage = actor.num_layers_per_virtual_pipeline_stage
    for key in megatron:
        section = _section(cfg, key)
        num_layers = convert.Layout.from_hf_config((role_configs or {}).get(key, hf_config)).num_layers
        vpp = virtual_stages_from_layers_per_stage(key, section.megatron, num_layers)
        if vpp is not None:
            section.megatron.virtual_pipeline_model_parallel_size = vpp


def check_roles(cfg: Any, hf_config: Any, roles: dict[str, bool], role_configs: dict[str, Any] | None = None) -> None:
    """Check every role (`{"actor_rollout_ref.actor": in use, ...}`) whose strategy is megatron;
    `role_configs` holds the HF config of a role whose model is not the policy's (a reward model)."""
    megatron = {key: _section(cfg, key) for key, used in roles.items()
                if used and _section(cfg, key).strategy == "megatron"}
    if not megatron:
        return
    actor = cfg.actor_rollout_ref.actor
    if actor.use_kl_loss and actor.kl_loss_type == "full":
        raise ValueError("actor_rollout_ref.actor.kl_loss_type=full needs full-vocabulary logits, which the "
                         "Megatron engine does not return (vocabulary-parallel heads): use k1/k2/k3 (kl, mse, "
                         "low_var_kl), or strategy=fsdp2.")
    if cfg.trainer.device == "cpu":
        check_version()
    own_pool = {"reward_model"} if cfg.reward_model.enable_resource_pool else set()
    for key in megatron:
        layout = convert.Layout.from_hf_config((role_configs or {}).get(key, hf_config))
        pool = "reward_model" if key in own_pool else "trainer"
        ranks = _section(cfg, pool)
        check_layout(key, _section(cfg, key).megatron, layout, ranks.nnodes * ranks.n_gpus_per_node, pool)
        check_replayable(key, replay_mode(_section(cfg, key)), layout)
        frozen_routers(key, _section(cfg, key).megatron, layout)
    # The roles in one process share its megatron groups (a reward model in its own pool has its own).
    sizes = {key: (*parallel_sizes(_section(cfg, key).megatron)[:2], expert_parallel_size(_section(cfg, key).megatron),
                   context_parallel_size(_section(cfg, key).megatron))
             for key in megatron if key not in own_pool}
    if len(set(sizes.values())) > 1:
        found = ", ".join(f"{key}: TP={tp}, PP={pp}, EP={ep}, CP={cp}" for key, (tp, pp, ep, cp) in sizes.items())
        raise ValueError(f"The roles on Megatron share one process layout, so their tensor_model_parallel_size, "
                         f"pipeline_model_parallel_size, expert_model_parallel_size and context_parallel_size must "
                         f"match ({found}): set the same values in each megatron section.")


def _section(cfg: Any, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node
