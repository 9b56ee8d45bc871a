"""Code that a run's config names: a Python file (`/path/to/file.py`, or verl's `file://` form) or
an importable module (verl's `pkg://package.module`), and an object in it, with errors that name
the setting to fix."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from types import ModuleType
from typing import Iterator

FILE_PREFIX, PACKAGE_PREFIX = "file://", "pkg://"


def _module_name_for(path: str) -> str:
    """A module name per file and content: two files with one stem do not replace each other, and
    a file named twice (the training and the validation data's class) is imported once."""
    with open(path, "rb") as handle:
        digest = hashlib.sha1(path.encode() + b"\0" + handle.read()).hexdigest()[:12]
    stem = os.path.splitext(os.path.basename(path))[0]
    safe = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in stem)
    return f"hybrid_rl_user_{safe}_{digest}"


def load_module(path: str | os.PathLike, key: str) -> ModuleType:
    """The module at `path` (`key`: the setting that names it, for errors)."""
    path = str(path)
    if path.startswith(PACKAGE_PREFIX):
        module_name = path[len(PACKAGE_PREFIX):].replace("/", ".")
        try:
            return importlib.import_module(module_name)
        except Exception as exc:  # re-raised with the setting to fix
            raise ValueError(f"{key}={path}: importing the module {module_name} failed with {type(exc).__name__}: "
                             f"{exc}. Make it importable (installed, or on PYTHONPATH) or give a .py file.") from exc
    path = os.path.abspath(os.path.expanduser(path.removeprefix(FILE_PREFIX)))
    if not os.path.exists(path):
        raise FileNotFoundError(f"{key}: file not found: {path}. Point it at an existing .py file (an absolute path is "
                                f"safest; relative paths are resolved against the working directory {os.getcwd()}), "
                                f"or at a module as {PACKAGE_PREFIX}package.module.")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{key}={path} is not a regular file; point it at a .py file.")
    module_name = _module_name_for(path)
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{key}={path}: Python does not recognise it as a module; name a .py source file.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # lets dataclasses and pickle resolve the module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # re-raised with the setting to fix
        sys.modules.pop(module_name, None)
        raise ValueError(f"importing {path} ({key}) failed with {type(exc).__name__}: {exc}. Fix the error in that "
                         f"file (try `python {path}` to reproduce it) or point {key} at another file.") from exc
    return module


@contextlib.contextmanager
def verl_stand_ins(modules: dict[str, dict[str, object]]) -> Iterator[None]:
    """While a user's file written for verl loads, its imports of verl's modules (`modules`: a
    dotted name and the names it provides, e.g. {"verl.tools.function_tool": {"function_tool": ours}})
    get ours; verl itself, if installed, is back in place after."""
    names = {parent for name in modules for parent in (".".join(name.split(".")[:i + 1])
                                                          for i in range(name.count(".") + 1))}
    shadowed = {name: sys.modules.get(name) for name in names}
    for name in sorted(names):
        module = sys.modules[name] = ModuleType(name)
        for attr, value in modules.get(name, {}).items():
            setattr(module, attr, value)
        if "." in name:
            parent, _, child = name.rpartition(".")
            setattr(sys.modules[parent], child, module)
    try:
        yield
    finally:
        for name, previous in shadowed.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous


def public_names(module: ModuleType) -> list[str]:
    """The functions and classes a module defines or imports, but not its modules or private names."""
    return sorted(attr for attr, value in vars(module).items()
                  if not attr.startswith("_") and not inspect.ismodule(value) and callable(value))


def load_object(path: str | os.PathLike, name: str, key: str, expected: str) -> object:
    """`name` from the module at `path`, as named by the settings `key`.path and `key`.name;
    `expected` says what it should be, for the error when it is missing."""
    module = load_module(path, f"{key}.path")
    if not hasattr(module, name):
        found = public_names(module)
        raise ValueError(f"{path} has no attribute {name!r} ({key}.name). Functions and classes found there: "
                         f"{found if found else 'none'}. Set {key}.name to one of them, or define {expected}.")
    return getattr(module, name)


def load_class(qualified_name: str, key: str) -> type:
    """The class `package.module.Class` (verl's fully qualified name), named by the setting `key`."""
    module_name, _, name = str(qualified_name).rpartition(".")
    if not module_name or not name:
        raise ValueError(f"{key}={qualified_name} must be a fully qualified class name, package.module.Class.")
    module = load_module(PACKAGE_PREFIX + module_name, key)
    found = getattr(module, name, None)
    if not inspect.isclass(found):
        classes = [attr for attr in public_names(module) if inspect.isclass(getattr(module, attr))]
        raise ValueError(f"{key}={qualified_name}: the module {module_name} has no class {name!r}; its classes: "
                         f"{', '.join(classes) or 'none'}.")
    return found


# verl's keys naming modules to import before any model is read.
EXTERNAL_LIB_KEYS = ("actor_rollout_ref.model.external_lib", "critic.model.external_lib",
                     "reward_model.model.external_lib")


def import_external_libs(cfg) -> None:
    """verl's `model.external_lib`: a module name (or a list of them; here a .py file too),
    imported in the driver and in every worker before a model is read, so that what it registers
    (transformers' Auto classes, vLLM's model registry) is there for the trainer and the engine."""
    from omegaconf import OmegaConf

    for key in EXTERNAL_LIB_KEYS:
        libs = OmegaConf.select(cfg, key)
        for lib in [libs] if isinstance(libs, str) else list(libs or []):
            is_file = lib.endswith(".py") or lib.startswith((FILE_PREFIX, PACKAGE_PREFIX))
            load_module(lib if is_file else PACKAGE_PREFIX + lib, key)

