"""The FSDP engine's optimizer, chosen as verl chooses it: the class `optim.optimizer` from the
module `optim.optimizer_impl` (torch.optim's AdamW by default; any other torch.optim class, or a
class of another module that subclasses torch's Optimizer, such as torchao.optim's)."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch

from hybrid_rl.config_keys import plain

# Constructor arguments no key sets: the optimizer itself and the parameters the engine passes.
# (lr, weight_decay and betas come from their keys, and an override may still set them, as in verl.)
_FROM_THE_ENGINE = ("self", "params")


# The optim section of `--config-name=ppo_megatron_trainer` names megatron's optimizers, also for a
# role on the FSDP engine there; megatron's adam is AdamW. (torch.optim has no class of these names.)
MEGATRON_NAMES = {"adam": "AdamW", "sgd": "SGD"}


def _names(optim_cfg: Any) -> tuple[str, str]:
    """(module, class name), verl's torch.optim.AdamW where a config (an older verl's) names none."""
    module_name, name = optim_cfg.get("optimizer_impl", "torch.optim"), optim_cfg.get("optimizer", "AdamW")
    if module_name == "torch.optim":
        name = MEGATRON_NAMES.get(name, name)
    return module_name, name


def optimizer_class(key: str, optim_cfg: Any) -> type[torch.optim.Optimizer]:
    """`optim.optimizer` in `optim.optimizer_impl`; `key` names the role's optim section in errors."""
    module_name, name = _names(optim_cfg)
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"{key}.optimizer_impl={module_name} cannot be imported ({error}); install the package "
                         "that provides it, or use torch.optim.") from None
    found = getattr(module, name, None)
    if not (isinstance(found, type) and issubclass(found, torch.optim.Optimizer)):
        available = sorted(attr for attr, value in vars(module).items() if isinstance(value, type)
                           and issubclass(value, torch.optim.Optimizer) and value is not torch.optim.Optimizer)
        raise ValueError(f"{key}.optimizer={optim_cfg.get('optimizer')} is not an optimizer class of {module_name}; "
                         f"it has {', '.join(available) or 'none'}.")
    return found


def optimizer_arguments(key: str, optim_cfg: Any, cls: type[torch.optim.Optimizer]) -> dict:
    """The class's arguments as verl builds them: lr and weight_decay, betas for an Adam-like
    class (by its configured name, as verl decides), `override_optimizer_config` over them.
    torch's own Adam and AdamW take their fused kernel unless the override asks for foreach."""
    module_name, class_name = _names(optim_cfg)
    arguments = {"lr": optim_cfg.lr, "weight_decay": optim_cfg.weight_decay}
    if "adam" in class_name.lower() or "ademamix" in class_name.lower():
        arguments["betas"] = tuple(optim_cfg.betas)
    if cls in (torch.optim.AdamW, torch.optim.Adam):
        # One pass over each tensor (CPU and CUDA, DTensor shards included); the default for-each
        # path costs ~5x more on CPU.
        arguments["fused"] = True
    override = plain(optim_cfg.get("override_optimizer_config")) or {}
    if not isinstance(override, dict):
        raise ValueError(f"{key}.override_optimizer_config={override} must be a mapping of optimizer arguments, "
                         "e.g. {eps: 1e-6}.")
    arguments.update(override)
    if arguments.get("foreach"):  # torch takes one of the two implementations
        arguments.pop("fused", None)
    parameters = inspect.signature(cls).parameters
    if "weight_decay" not in parameters and not arguments["weight_decay"] and "weight_decay" not in override:
        del arguments["weight_decay"]  # no decay, for a class that has none
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        accepted = [name for name in parameters if name not in _FROM_THE_ENGINE]
        unknown = {name: "override_optimizer_config" if name in override else name
                   for name in arguments if name not in accepted}
        if unknown:
            raise ValueError(f"{module_name}.{class_name} does not take "
                             f"{', '.join(f'{name} (from {key}.{source})' for name, source in unknown.items())}; "
                             f"its arguments: {', '.join(accepted)}. Leave those keys out (weight_decay at 0).")
    return arguments


def build(key: str, optim_cfg: Any, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    cls = optimizer_class(key, optim_cfg)
    return cls(params, **optimizer_arguments(key, optim_cfg, cls))
