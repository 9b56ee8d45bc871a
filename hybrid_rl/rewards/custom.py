"""Load a user-supplied reward function from a Python file (or a module: `user_code`)."""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any, Callable, Mapping

from hybrid_rl.user_code import load_object

EXPECTED_SIGNATURE = "fn(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict"
# verl's batch reward manager calls it once per batch, with a list of each.
SAMPLE_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")
BATCH_ARGUMENTS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")
EXPECTED_BATCH_SIGNATURE = "fn(data_sources, solution_strs, ground_truths, extra_infos, **kwargs) -> list[float | dict]"


def load_custom_reward_fn(
    path: str | os.PathLike | None,
    name: str | None = "compute_score",
    reward_kwargs: Mapping[str, Any] | None = None,
    key: str = "custom_reward_function",
    provided: tuple[str, ...] = (),
    batched: bool = False,
) -> Callable | None:
    """Import ``name`` from the Python file at ``path`` (or the module `pkg://package.module`).

    Returns ``None`` when ``path`` is empty (no custom function configured).
    ``reward_kwargs`` are bound as keyword arguments with ``functools.partial``.
    The function must accept the keyword arguments ``data_source``,
    ``solution_str``, ``ground_truth`` and ``extra_info``; this is checked here
    so a wrong signature fails at start-up rather than at the first reward.
    ``key`` is the config section the error messages name; ``provided`` names further keyword
    arguments the caller may pass (the served reward model's) to a function that takes them.
    ``batched`` (the batch reward manager's): the function takes the lists ``data_sources``,
    ``solution_strs``, ``ground_truths`` and ``extra_infos`` instead.
    """
    if path is None or str(path).strip() == "":
        return None
    name = name or "compute_score"
    expected, arguments = (EXPECTED_BATCH_SIGNATURE, BATCH_ARGUMENTS) if batched else (EXPECTED_SIGNATURE,
                                                                                      SAMPLE_ARGUMENTS)
    fn = load_object(path, name, key, f"{name}({expected.split('(', 1)[1]}")
    if not callable(fn):
        raise ValueError(
            f"{name!r} in custom reward file {path} is of type {type(fn).__name__}, not a function. "
            f"Set {key}.name to a function with signature {expected}."
        )

    kwargs = dict(reward_kwargs or {})
    clash = sorted(set(kwargs) & set(arguments))
    if clash:
        raise ValueError(
            f"{key}.reward_kwargs sets {clash}, which the reward manager passes "
            "itself; remove them from reward_kwargs."
        )

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None  # builtins/C callables: cannot introspect, trust the user
    if sig is not None:
        try:
            sig.bind(**dict.fromkeys(arguments), **kwargs, **{p: None for p in provided if keyword_parameter(fn, p)})
        except TypeError as exc:
            extra = f" with reward_kwargs {sorted(kwargs)}" if kwargs else ""
            raise ValueError(
                f"custom reward function {name!r} in {path} has signature {name}{sig}, "
                f"which cannot be called as fn({', '.join(f'{a}=...' for a in arguments)}"
                f"{', **reward_kwargs' if kwargs else ''}){extra}: {exc}. "
                f"Change it to {expected}"
                + (f" or fix {key}.reward_kwargs" if kwargs else "")
                + "."
            ) from exc
    if kwargs:
        fn = functools.partial(fn, **kwargs)
    return fn


def keyword_parameter(fn: Callable, name: str) -> str | None:
    """How ``fn`` takes the keyword argument ``name``: "required", "optional" (with a default, or
    through ``**kwargs``) or None (it does not)."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    param = parameters.get(name)
    if param is not None and param.kind is not param.POSITIONAL_ONLY:
        return "required" if param.default is param.empty else "optional"
    return "optional" if any(p.kind is p.VAR_KEYWORD for p in parameters.values()) else None


def load_function_ref(ref: str, key: str, provided: tuple[str, ...] = ()) -> Callable:
    """A reward function named as "file.py:function" (or "file.py" for its compute_score), as
    `reward.funcs` entries and the step scorers name them; `key` is the setting named in errors."""
    path, name = ref.rsplit(":", 1) if ":" in ref and ref.rsplit(":", 1)[0].endswith(".py") else (ref, None)
    return load_custom_reward_fn(path, name, key=key, provided=provided)
