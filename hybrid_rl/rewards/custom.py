"""Load a user-supplied reward function from a Python file."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import os
import sys
from typing import Any, Callable, Mapping

EXPECTED_SIGNATURE = "fn(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict"


def _module_name_for(path: str) -> str:
    digest = hashlib.sha1(path.encode()).hexdigest()[:12]
    stem = os.path.splitext(os.path.basename(path))[0]
    safe = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in stem)
    return f"hybrid_rl_custom_reward_{safe}_{digest}"


def _callables_defined_in(module) -> list[str]:
    names = []
    for attr, value in vars(module).items():
        if attr.startswith("_") or inspect.ismodule(value) or not callable(value):
            continue
        names.append(attr)
    return sorted(names)


def load_custom_reward_fn(
    path: str | os.PathLike | None,
    name: str | None = "compute_score",
    reward_kwargs: Mapping[str, Any] | None = None,
    key: str = "custom_reward_function",
    provided: tuple[str, ...] = (),
) -> Callable | None:
    """Import ``name`` from the Python file at ``path``.

    Returns ``None`` when ``path`` is empty (no custom function configured).
    ``reward_kwargs`` are bound as keyword arguments with ``functools.partial``.
    The function must accept the keyword arguments ``data_source``,
    ``solution_str``, ``ground_truth`` and ``extra_info``; this is checked here
    so a wrong signature fails at start-up rather than at the first reward.
    ``key`` is the config section the error messages name; ``provided`` names further keyword
    arguments the caller may pass (the served reward model's) to a function that takes them.
    """
    if path is None or str(path).strip() == "":
        return None
    name = name or "compute_score"
    path = os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"custom reward function file not found: {path}. "
            f"Fix {key}.path to point at an existing .py file "
            "(an absolute path is safest; relative paths are resolved against the working directory "
            f"{os.getcwd()})."
        )
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{key}.path={path} is not a regular file; point it at a .py file"
        )

    module_name = _module_name_for(path)
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(
            f"cannot import custom reward file {path}: Python does not recognise it as a module. "
            f"Make sure {key}.path names a .py source file."
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # lets dataclasses/pickle resolve the module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # re-raised with context below
        sys.modules.pop(module_name, None)
        raise ValueError(
            f"importing custom reward file {path} failed with {type(exc).__name__}: {exc}. "
            "Fix the error in that file (try `python " + path + "` to reproduce it) "
            f"or point {key}.path at another file."
        ) from exc

    if not hasattr(module, name):
        found = _callables_defined_in(module)
        raise ValueError(
            f"custom reward file {path} has no attribute {name!r}. "
            f"Callables found in the file: {found if found else 'none'}. "
            f"Set {key}.name to one of them, or define "
            f"{name}({EXPECTED_SIGNATURE.split('(', 1)[1]}"
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise ValueError(
            f"{name!r} in custom reward file {path} is of type {type(fn).__name__}, not a function. "
            f"Set {key}.name to a function with signature {EXPECTED_SIGNATURE}."
        )

    kwargs = dict(reward_kwargs or {})
    clash = sorted(set(kwargs) & {"data_source", "solution_str", "ground_truth", "extra_info"})
    if clash:
        raise ValueError(
            f"{key}.reward_kwargs sets {clash}, which the reward manager passes "
            "itself for every sample; remove them from reward_kwargs."
        )

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None  # builtins/C callables: cannot introspect, trust the user
    if sig is not None:
        try:
            sig.bind(data_source="x", solution_str="x", ground_truth="x", extra_info=None, **kwargs,
                     **{p: None for p in provided if keyword_parameter(fn, p)})
        except TypeError as exc:
            extra = f" with reward_kwargs {sorted(kwargs)}" if kwargs else ""
            raise ValueError(
                f"custom reward function {name!r} in {path} has signature {name}{sig}, "
                f"which cannot be called as fn(data_source=..., solution_str=..., ground_truth=..., "
                f"extra_info=...{', **reward_kwargs' if kwargs else ''}){extra}: {exc}. "
                f"Change it to {EXPECTED_SIGNATURE}"
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
