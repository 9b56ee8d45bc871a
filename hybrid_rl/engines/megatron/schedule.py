"""The Megatron engine's learning-rate and weight-decay schedule: megatron's own
`OptimizerParamScheduler`, set from verl's Megatron optimizer keys as verl's Megatron engine
sets it.

- warmup: `lr_warmup_steps` (or, when it is not positive, `lr_warmup_steps_ratio` x the decay
  steps), linear from `lr_warmup_init` to `lr`, reaching `lr` at the end of the warmup;
- decay: `lr_decay_style` (constant, linear, cosine, inverse-square-root, or WSD: constant, then
  `lr_wsd_decay_style` over the last `lr_wsd_decay_steps`) from `lr` to `min_lr` over
  `lr_decay_steps` (default: the run's training steps);
- weight decay: `weight_decay` on every weight but biases and one-dimensional ones (norms), which
  megatron's optimizer groups with no decay; verl gives megatron the same start and end decay, so
  `weight_decay_incr_style` changes nothing;
- one scheduler step per training step (per `update`), as verl steps it.

`lr_scheduler_type`, `min_lr_ratio` and `num_cycles` are the FSDP engine's keys, which verl's
Megatron engine ignores. Here `lr_scheduler_type=cosine` asks for megatron's cosine decay to
`min_lr_ratio` x `lr` (megatron's cosine is the half cycle of `num_cycles=0.5`), so a command
line works the same on both engines apart from the warmup's first step.
"""

from __future__ import annotations

import math
from typing import Any

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
WEIGHT_DECAY_STYLES = ("constant", "linear", "cosine")
# The keys only this schedule reads, with verl's defaults.
DEFAULTS = {"lr_warmup_init": 0.0, "lr_decay_steps": None, "lr_decay_style": "constant", "min_lr": 0.0,
            "weight_decay_incr_style": "constant", "lr_wsd_decay_style": "exponential", "lr_wsd_decay_steps": None,
            "use_checkpoint_opt_param_scheduler": False}


def _choice(value, valid: tuple[str, ...], key: str) -> None:
    if value not in valid:
        raise ValueError(f"{key}={value} is not one of {', '.join(valid)}.")


def decay(key: str, optim: Any) -> tuple[str, float]:
    """The decay style and the minimum learning rate, from megatron's keys or the FSDP ones;
    refuses settings that contradict each other or that megatron's schedule cannot follow."""
    lr = float(optim.lr)
    style = optim.get("lr_decay_style") or "constant"
    min_lr = float(optim.get("min_lr") or 0.0)
    _choice(style, DECAY_STYLES, f"{key}.lr_decay_style")
    if optim.get("lr_scheduler_type", "constant") == "cosine":
        if style not in ("constant", "cosine"):
            raise ValueError(f"{key}.lr_scheduler_type=cosine and {key}.lr_decay_style={style} ask for two "
                             f"schedules; on the Megatron engine set {key}.lr_decay_style alone.")
        cycles = optim.get("num_cycles", 0.5)
        if cycles != 0.5:
            raise ValueError(f"{key}.num_cycles={cycles}: megatron's cosine decay (the Megatron engine's schedule) "
                             "is a half cycle; set num_cycles=0.5, or train on the FSDP engine.")
        from_ratio = float(optim.get("min_lr_ratio") or 0.0) * lr
        if min_lr and from_ratio and not math.isclose(min_lr, from_ratio):
            raise ValueError(f"{key}.min_lr={min_lr} and {key}.min_lr_ratio x lr = {from_ratio} disagree; set one.")
        style, min_lr = "cosine", min_lr or from_ratio
    if style == "WSD":
        _choice(optim.get("lr_wsd_decay_style"), WSD_DECAY_STYLES, f"{key}.lr_wsd_decay_style")
        if not (optim.get("lr_wsd_decay_steps") or 0) > 0:
            raise ValueError(f"{key}.lr_decay_style=WSD needs {key}.lr_wsd_decay_steps: the number of final steps "
                             "over which the learning rate anneals.")
    _choice(optim.get("weight_decay_incr_style") or "constant", WEIGHT_DECAY_STYLES,
            f"{key}.weight_decay_incr_style")
    if not 0.0 <= min_lr <= lr:
        raise ValueError(f"{key}.min_lr={min_lr} must be between 0 and {key}.lr={lr}.")
    if not 0.0 <= float(optim.get("lr_warmup_init") or 0.0) <= lr:
        raise ValueError(f"{key}.lr_warmup_init={optim.get('lr_warmup_init')} must be between 0 and {key}.lr={lr}.")
    return style, min_lr


def settings(key: str, optim: Any, total_steps: int) -> dict:
    """`OptimizerParamScheduler`'s arguments for a run of `total_steps` training steps."""
    style, min_lr = decay(key, optim)
    decay_steps = optim.get("lr_decay_steps") or total_steps
    warmup = optim.get("lr_warmup_steps")
    if warmup is None or warmup <= 0:
        warmup = int((optim.get("lr_warmup_steps_ratio") or 0.0) * decay_steps)
    if not 0 <= warmup < decay_steps:
        raise ValueError(f"{key}: {warmup} warmup steps do not fit in {decay_steps} decay steps "
                         f"({key}.lr_decay_steps, or the run's training steps when it is null); shorten "
                         f"{key}.lr_warmup_steps / lr_warmup_steps_ratio or lengthen {key}.lr_decay_steps.")
    use_checkpoint = bool(optim.get("use_checkpoint_opt_param_scheduler", False))
    weight_decay = float(optim.weight_decay)
    return {"init_lr": float(optim.get("lr_warmup_init") or 0.0), "max_lr": float(optim.lr), "min_lr": min_lr,
            "lr_warmup_steps": warmup, "lr_decay_steps": decay_steps, "lr_decay_style": style,
            "start_wd": weight_decay, "end_wd": weight_decay, "wd_incr_steps": total_steps,
            "wd_incr_style": optim.get("weight_decay_incr_style") or "constant",
            "use_checkpoint_opt_param_scheduler": use_checkpoint, "override_opt_param_scheduler": not use_checkpoint,
            "wsd_decay_steps": optim.get("lr_wsd_decay_steps"), "lr_wsd_decay_style": optim.get("lr_wsd_decay_style")}


class MegatronSchedule:
    """megatron's `OptimizerParamScheduler` over megatron's (chained) optimizer, with the small
    interface the trainer uses of a torch LR scheduler."""

    def __init__(self, optimizer: Any, arguments: dict):
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.scheduler = OptimizerParamScheduler(optimizer, **arguments)

    def step(self) -> None:
        self.scheduler.step(1)

    def get_last_lr(self) -> list[float]:
        from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging

        groups = self.scheduler.optimizer.param_groups
        lr = get_canonical_lr_for_logging(groups)
        return [groups[0]["lr"] if lr is None else lr]

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if "schedules" in state:  # a checkpoint from before megatron's scheduler: torch LambdaLRs' states
            state = {**self.scheduler.state_dict(), "num_steps": state["schedules"][0]["last_epoch"]}
        self.scheduler.load_state_dict(state)
