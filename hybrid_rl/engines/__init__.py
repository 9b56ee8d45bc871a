"""Training engines behind one interface (`base.TrainEngine`), chosen by a role's `strategy`."""

from hybrid_rl.algorithms.registry import Registry
from hybrid_rl.engines.base import Head, ModelSpec, Output, TrainEngine
from hybrid_rl.engines.fsdp import FSDPEngine
from hybrid_rl.engines.megatron.engine import MegatronEngine

ENGINES = Registry("training engine (strategy)")
ENGINES.register("fsdp2", "fsdp")(FSDPEngine)
ENGINES.register("megatron")(MegatronEngine)


def build_engine(spec: ModelSpec, role_cfg, device) -> TrainEngine:
    """The engine `role_cfg.strategy` names, holding the model `spec` describes."""
    return ENGINES.get(role_cfg.strategy)(spec, role_cfg, device)


__all__ = ["ENGINES", "FSDPEngine", "Head", "MegatronEngine", "ModelSpec", "Output", "TrainEngine", "build_engine"]
