"""A reward manager of one's own, written for verl: the class `reward.reward_manager.name` (verl
0.7-0.8: `reward_manager.name`) of the file `module.path` with `source=importlib`.

verl has two interfaces, both taken here as verl takes them:

* ``RewardManagerBase`` (verl 0.9's reward loop): built as ``cls(config=, tokenizer=,
  compute_score=, reward_router_address=None, reward_model_tokenizer=None)``; ``async
  run_single(data)`` scores one sample (``data`` a one-row DataProto) and returns
  ``{"reward_score": float, "reward_extra_info": dict}``.
* ``AbstractRewardManager`` (verl 0.3-0.8): built as ``cls(tokenizer=, num_examine=,
  compute_score=, reward_fn_key=, **reward_kwargs)``; ``__call__(data, return_dict=True)`` scores
  the whole batch and returns ``{"reward_tensor": (B, T), "reward_extra_info": {key: B values}}``
  (or the tensor alone).

The file's imports of those verl modules, of ``verl.DataProto`` and of verl's
``default_compute_score`` get ours while it loads (`user_code.verl_stand_ins`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable

from hybrid_rl.protocol import DataProtoView

__all__ = ["AbstractRewardManager", "RewardManagerBase", "load_reward_manager_class"]


class RewardManagerBase(ABC):
    """verl 0.9's interface: one sample at a time, asynchronously."""

    _class_initialized = False

    def __init__(self, config, tokenizer, compute_score: Callable | None):
        self.config = config
        self.tokenizer = tokenizer
        self.compute_score = compute_score
        self.loop = None  # the running loop: the reward manager sets it before each batch's run_single calls
        self.init_class(config, tokenizer)

    @classmethod
    def init_class(cls, config, tokenizer) -> None:
        """State shared by all instances, set up once."""
        if cls._class_initialized:
            return
        cls._class_initialized = True

    @abstractmethod
    async def run_single(self, data) -> dict:
        raise NotImplementedError


class AbstractRewardManager(ABC):
    """verl 0.3-0.8's interface: the whole batch in one call."""

    @abstractmethod
    def __init__(self, tokenizer: Any, num_examine: int, compute_score: Callable | None,
                 reward_fn_key: str = "data_source", **kwargs: Any):
        pass

    @abstractmethod
    def __call__(self, data, return_dict: bool = False):
        pass

    def _extract_reward_from_rm_scores(self, data, return_dict: bool = False):
        """verl's helper: a reward model's scores already in the batch (``rm_scores``), else None."""
        if "rm_scores" not in data.batch.keys():
            return None
        if not return_dict:
            return data.batch["rm_scores"]
        keys = data.meta_info.get("reward_extra_keys", [])
        return {"reward_tensor": data.batch["rm_scores"],
                "reward_extra_info": {key: data.non_tensor_batch[key] for key in keys}}


def register(name: str):
    """verl's registration decorator: the class is found by its name in the file here."""
    def decorator(cls):
        return cls

    return decorator


def load_reward_manager_class(path: str, name: str, key: str) -> type:
    """The class `name` of the file (or pkg://module) `path`; `key` names the settings in errors."""
    from hybrid_rl.rewards import default_compute_score
    from hybrid_rl.user_code import load_module, public_names, verl_stand_ins

    loop_interface = {"RewardManagerBase": RewardManagerBase, "register": register}
    legacy_interface = {"AbstractRewardManager": AbstractRewardManager, "register": register,
                        "RawRewardFn": Callable[..., Any]}
    with verl_stand_ins({"verl": {"DataProto": DataProtoView}, "verl.protocol": {"DataProto": DataProtoView},
                         "verl.experimental.reward_loop.reward_manager": loop_interface,
                         "verl.experimental.reward_loop.reward_manager.base": loop_interface,
                         "verl.workers.reward_manager": legacy_interface,
                         "verl.workers.reward_manager.abstract": legacy_interface,
                         "verl.utils.reward_score": {"default_compute_score": default_compute_score}}):
        module = load_module(path, f"{key}.module.path")
    cls = getattr(module, str(name), None)
    if cls is None:
        found = public_names(module)
        raise ValueError(f"{path} has no class {name!r} ({key}.name, the class verl loads from {key}.module.path); "
                         f"found there: {', '.join(found) or 'nothing'}.")
    if not (isinstance(cls, type) and issubclass(cls, (RewardManagerBase, AbstractRewardManager))):
        raise ValueError(f"{key}.name={name} in {path} must be a class derived from verl's RewardManagerBase "
                         "(verl.experimental.reward_loop.reward_manager.base) or AbstractRewardManager "
                         f"(verl.workers.reward_manager.abstract); got {cls!r}.")
    return cls
