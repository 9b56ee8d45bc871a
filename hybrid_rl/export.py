"""Export a training checkpoint as a plain Hugging Face model folder (safetensors).

A checkpoint written by the trainer (see `hybrid_rl.checkpoint`) holds the model as a sharded
`torch.distributed.checkpoint` (DCP) folder next to the optimizer state (the Megatron engine's is
a megatron dist-checkpoint, which is DCP underneath, with megatron's names), plus a `huggingface/`
folder with the config, tokenizer, chat template and generation config. This module reads only
the model tensors of one role (`actor` or `critic`) in a single process, with no process group,
and writes a folder that `transformers.AutoModel*.from_pretrained` and vLLM load directly:

    from hybrid_rl.export import export_checkpoint
    export_checkpoint("checkpoints/run1", "exported/run1")      # latest step of a run
    export_checkpoint("checkpoints/run1/global_step_40", "exported/step40", dtype="bfloat16")

or from the command line: `hybrid-rl-export CHECKPOINT OUT_DIR [--role] [--dtype]` (in a checkout
also `python tools/export_hf.py ...`).

A LoRA run's checkpoint holds only the adapter (next to peft's `adapter_config.json`): the export
rebuilds it with peft on the run's base model (`actor_rollout_ref.model.path`, the critic's
`critic.model.path`, or `base_model`) and writes the merged model, or with `adapter_only` the
adapter in peft's own format (a critic's with its value head, which trains whole).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import uuid
import warnings
from pathlib import Path

import torch

from hybrid_rl.checkpoint import POINTER, STATE, STEP_DIR, CheckpointManager
from hybrid_rl.engines import lora
from hybrid_rl.engines.base import MODEL_KEYS
from hybrid_rl.engines.megatron import convert
from hybrid_rl.engines.megatron import lora as megatron_lora
from hybrid_rl.hardware import TORCH_DTYPES

logger = logging.getLogger(__name__)

ROLES = ("actor", "critic")
HF_DIR = "huggingface"
MODEL_KEY = "model"  # top-level key of the model's state dict inside the DCP checkpoint (see engines/fsdp.py)
# Files of huggingface/ that the exported folder gets from save_pretrained instead of copying.
_NOT_COPIED = {"config.json"}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


class ExportError(ValueError):
    pass


# --------------------------------------------------------------------------- locating the checkpoint
def resolve_step_folder(checkpoint: str | os.PathLike) -> Path:
    """`checkpoint` is a `global_step_<N>` folder, or a run folder whose latest pointer names one."""
    path = Path(os.path.expanduser(str(checkpoint)))
    if not path.exists():
        raise FileNotFoundError(
            f"Checkpoint {path} does not exist. Pass a run folder (trainer.default_local_dir, holding "
            f"{POINTER}) or one of its global_step_<N> folders.")
    if not path.is_dir():
        raise ExportError(f"Checkpoint {path} is a file, not a folder. Pass a run folder "
                          f"(trainer.default_local_dir) or one of its global_step_<N> folders.")
    if (path / STATE).is_file() or STEP_DIR.match(path.name):
        return path
    manager = CheckpointManager(str(path))
    latest = manager.latest()  # raises CheckpointError (a ValueError) for a dangling pointer
    if latest is None:
        steps = [p.name for p in manager.completed()]
        if steps:
            raise ExportError(
                f"Run folder {path} has no {POINTER}, so the latest checkpoint is unknown. Pass one of its "
                f"step folders explicitly, e.g. {path / steps[-1]} (complete ones: {steps}).")
        raise ExportError(
            f"{path} is neither a checkpoint step folder (no {STATE}) nor a run folder (no {POINTER} and no "
            "global_step_<N> folders). Pass trainer.default_local_dir of a run that saved checkpoints "
            "(trainer.save_freq > 0), or one of its global_step_<N> folders.")
    return latest


def _check_step_folder(step: Path, role: str) -> Path:
    if role not in ROLES:
        raise ExportError(f"role={role!r} is not valid. Valid choices: {', '.join(ROLES)}.")
    if not (step / STATE).is_file():
        raise ExportError(
            f"{step} is not a complete checkpoint (no {STATE}); it was probably interrupted while saving. "
            "Export an earlier global_step_<N> folder.")
    hf = step / HF_DIR
    if not (hf / "config.json").is_file():
        raise FileNotFoundError(
            f"{hf / 'config.json'} is missing: the checkpoint has no {HF_DIR}/ folder with the model config "
            "(checkpoints written by older versions lack it). Copy config.json and the tokenizer files of the "
            f"model you trained (actor_rollout_ref.model.path) into {hf} and export again.")
    role_dir = step / role
    if not role_dir.is_dir():
        present = [r for r in ROLES if (step / r).is_dir()]
        hint = " (the run had no critic: critic checkpoints exist only for PPO with a value model)" \
            if role == "critic" else ""
        fix = (f"Roles saved in this checkpoint: {present}; pass role={present[0]!r} (--role {present[0]})."
               if present else f"{step} holds no model weights; export another global_step_<N> folder.")
        raise FileNotFoundError(f"{role_dir} does not exist{hint}. {fix}")
    if not (role_dir / ".metadata").is_file():
        raise ExportError(
            f"{role_dir} has no .metadata file: the torch.distributed.checkpoint is incomplete or corrupt. "
            "Export an earlier global_step_<N> folder.")
    return role_dir


# --------------------------------------------------------------------------- reading the weights
def _root_cause(exc: BaseException) -> str:
    """One line for an error; DCP wraps each rank's exception (with its traceback) in a
    CheckpointException, which derives from BaseException, not Exception."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        if isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
            exc = inner[0]
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text if len(text) <= 300 else text[:300] + '...'}"


def read_model_state(role_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model tensors of a DCP folder written by `save_sharded`, gathered into full CPU tensors
    in this process (no process group, optimizer state left unread). A Megatron checkpoint's
    come with megatron's names (`convert.hf_state_from_dist_checkpoint` renames them)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    role_dir = Path(role_dir)
    try:
        metadata = FileSystemReader(str(role_dir)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - any reader failure means an unreadable checkpoint
        raise ExportError(
            f"Cannot read the checkpoint metadata in {role_dir} ({_root_cause(exc)}); the checkpoint is "
            "corrupt or partially written. Export an earlier global_step_<N> folder.") from exc
    planner_data = metadata.planner_data or {}
    megatron = convert.is_dist_checkpoint(role_dir)
    model: dict[str, torch.Tensor] = {}
    for flat_key, meta in metadata.state_dict_metadata.items():
        path = planner_data.get(flat_key)
        if megatron:  # flat megatron keys; layers' extra state is bytes, skipped below
            if not flat_key.startswith(convert.DIST_CHECKPOINT_PREFIXES):
                continue
            name = flat_key
        elif path is not None:
            if len(path) != 2 or path[0] != MODEL_KEY:
                continue
            name = str(path[1])
        elif flat_key.startswith(MODEL_KEY + "."):
            name = flat_key[len(MODEL_KEY) + 1:]
        else:
            continue
        if not isinstance(meta, TensorStorageMetadata):
            if not megatron:
                logger.warning("Skipping non-tensor model entry %s in %s", name, role_dir)
            continue
        model[name] = torch.empty(meta.size, dtype=meta.properties.dtype)
    if not model:
        raise ExportError(
            f"{role_dir} holds no '{MODEL_KEY}' tensors (keys: {sorted(metadata.state_dict_metadata)[:5]}...); "
            "it is not a model checkpoint written by hybrid-rl.")
    state = model if megatron else {MODEL_KEY: model}
    try:
        with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": intended
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
            dcp.load(state, storage_reader=FileSystemReader(str(role_dir)), planner=DefaultLoadPlanner(),
                     no_dist=True)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - truncated shards, missing files, ...
        raise ExportError(
            f"Cannot read the model tensors in {role_dir} ({_root_cause(exc)}); the "
            "checkpoint is corrupt or partially written (a shard file may be missing or truncated). "
            "Export an earlier global_step_<N> folder.") from exc
    return model


# --------------------------------------------------------------------------- building the model
def _stored_model_config(step: Path, role: str):
    """The role's `model` section of the run's config, as the checkpoint recorded it."""
    from omegaconf import OmegaConf

    try:
        run_cfg = json.loads((step / STATE).read_text()).get("config") or {}
    except (OSError, json.JSONDecodeError) as exc:
        raise ExportError(f"Cannot read {step / STATE} ({exc}); the checkpoint is corrupt. "
                          "Export an earlier global_step_<N> folder.") from exc
    stored = (run_cfg.get(MODEL_KEYS[role].split(".")[0]) or {}).get("model") or {}
    # A checkpoint's config may come from a version without these keys: their defaults then. Its
    # huggingface/config.json is the one trained with (read from hf_config_path when that was set).
    return OmegaConf.create({"trust_remote_code": False, "override_config": {}, "path": None, **stored,
                             "hf_config_path": None})


def _role_config(step: Path, role: str):
    """The model config the role was trained with: huggingface/config.json plus the run's
    override_config (and the value head's settings for the critic), as the workers build it."""
    from hybrid_rl.models import model_config

    model_cfg = _stored_model_config(step, role)
    config = model_config(str(step / HF_DIR), model_cfg, scalar_head=role == "critic")
    return config, bool(model_cfg.trust_remote_code)


def _with_adapter(state: dict[str, torch.Tensor], role_dir: Path, base_model: str, config, trust: bool,
                  auto_class: str):
    """The base model (of transformers' `auto_class`) with the checkpoint's LoRA adapter, as a
    peft model (the plain model where only experts are adapted: `expert_deltas`). A critic's head,
    trained whole, is peft's trained copy of it (`modules_to_save`); the Megatron engine's
    checkpoints name it as the head itself."""
    import transformers
    from peft import LoraConfig, get_peft_model

    model = getattr(transformers, auto_class).from_pretrained(base_model, config=config, dtype=torch.float32,
                                                              trust_remote_code=trust)
    peft_config = LoraConfig.from_pretrained(str(role_dir))
    if not peft_config.target_modules:  # a critic's head may still be there
        model.load_state_dict(state, strict=False)
        return model
    state = dict(state)
    for head in set(peft_config.modules_to_save or ()):
        for key in [k for k in state if k.startswith(f"{head}.") and lora.TRAINED_COPY not in k]:
            state[f"{head}{lora.TRAINED_COPY}{key[len(head) + 1:]}"] = state.pop(key)
    peft_model = get_peft_model(model, peft_config)
    result = peft_model.get_base_model().load_state_dict(state, strict=False)
    not_set = [k for k in result.missing_keys if lora.is_trained_tensor(k)]
    if result.unexpected_keys or not_set:
        raise ExportError(
            f"The adapter in {role_dir} does not fit the base model {base_model}: "
            f"{len(result.unexpected_keys)} unexpected tensors (e.g. {result.unexpected_keys[:3]}), "
            f"{len(not_set)} adapter tensors not in the checkpoint (e.g. {not_set[:3]}). Pass the model the run "
            "trained from (--base-model).")
    return peft_model


# The transformers class each role's checkpoint holds.
ROLE_CLASSES = {"critic": "AutoModelForTokenClassification", "reward_model": "AutoModelForSequenceClassification"}


def _build_empty_model(config, auto_class: str, trust: bool):
    import transformers
    from accelerate import init_empty_weights

    auto = getattr(transformers, auto_class)
    # Parameters on the meta device (no memory, no random init); buffers such as rotary
    # frequencies are real, as they are not in checkpoints.
    with init_empty_weights(include_buffers=False):
        return auto.from_config(config, trust_remote_code=trust)


def _load_into(model, state: dict[str, torch.Tensor], source: Path) -> None:
    """Assign the checkpoint tensors to the meta-device model; tied weights may appear under one
    or both names. Raises ExportError listing missing/unexpected keys and shape mismatches."""
    expected = model.state_dict()
    tied = model.get_expanded_tied_weights_keys(all_submodels=True) if hasattr(
        model, "get_expanded_tied_weights_keys") else {}
    state = dict(state)
    for target, src in tied.items():
        if target in state and src in state:
            if not torch.equal(state[target], state[src]):
                raise ExportError(
                    f"The config ties {target} to {src} (tie_word_embeddings), but the checkpoint in {source} "
                    "holds different values for them. Set \"tie_word_embeddings\": false in "
                    f"{source.parent / HF_DIR / 'config.json'} (or the run's override_config) and export again.")
            state[target] = state[src]
        elif target in state:
            state[src] = state[target]
        elif src in state:
            state[target] = state[src]
    missing = sorted(k for k in expected if k not in state)
    unexpected = sorted(k for k in state if k not in expected)
    shapes = sorted(f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(v.shape)}"
                    for k, v in expected.items() if k in state and tuple(state[k].shape) != tuple(v.shape))
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (e.g. {missing[:5]})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (e.g. {unexpected[:5]})")
        if shapes:
            parts.append(f"{len(shapes)} with other shapes (e.g. {shapes[:3]})")
        raise ExportError(
            f"The tensors in {source} do not match the {type(model).__name__} built from "
            f"{source.parent / HF_DIR / 'config.json'}: {'; '.join(parts)}. The config must be the one the run "
            "trained (check the role: --role actor for the policy, --role critic for the value model).")
    model.load_state_dict(state, strict=True, assign=True)
    if tied:
        model.tie_weights()
    still_meta = [k for k, v in model.state_dict().items() if v.is_meta]
    if still_meta:
        raise ExportError(f"The checkpoint in {source} does not set {still_meta[:5]}; cannot export it.")


# --------------------------------------------------------------------------- writing
def _copy_hf_files(hf_dir: Path, out: Path) -> list[str]:
    copied = []
    for item in sorted(hf_dir.iterdir()):
        if item.name in _NOT_COPIED or item.name.endswith(_WEIGHT_SUFFIXES):
            continue
        if item.is_dir():
            shutil.copytree(item, out / item.name, dirs_exist_ok=True)
        else:
            shutil.copy2(item, out / item.name)
        copied.append(item.name)
    return copied


def write_folder(out: Path, write, overwrite: bool) -> None:
    """`write(tmp)` fills a temporary sibling of `out`, which then replaces `out` by renames
    (`_install`): `out` never holds a half-written folder."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp_{out.name}_{uuid.uuid4().hex[:8]}")
    try:
        write(tmp)
        _install(tmp, out, overwrite)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _install(tmp: Path, out: Path, overwrite: bool) -> None:
    """Move the finished temporary folder to `out` with renames only."""
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        if not overwrite:
            raise FileExistsError(f"{out} already exists and is not empty. Choose another output folder, "
                                  "delete it, or pass overwrite=True (--overwrite).")
        trash = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(out, trash)
        os.rename(tmp, out)
        shutil.rmtree(trash, ignore_errors=True)
        return
    os.replace(tmp, out)  # replaces an empty folder atomically on POSIX


def export_checkpoint(checkpoint: str, out_dir: str, role: str = "actor", dtype: str = "float32",
                      overwrite: bool = False, adapter_only: bool = False, base_model: str | None = None) -> str:
    """Write the `role` model of a checkpoint as a Hugging Face folder at `out_dir`; returns its path.

    `checkpoint` is a `global_step_<N>` folder or a run folder (its latest checkpoint is used).
    The folder gets `config.json` + `model.safetensors` in `dtype`, and the tokenizer files, chat
    template and `generation_config.json` the run trained with. It appears at `out_dir` only when
    complete (written to a temporary sibling folder, then renamed).

    A LoRA checkpoint is merged into its base model (`base_model`, default the run's
    `actor_rollout_ref.model.path`, or `critic.model.path`); with `adapter_only` the folder gets the adapter alone, as
    peft writes it (`adapter_config.json` + `adapter_model.safetensors`).
    """
    if dtype not in TORCH_DTYPES:
        raise ExportError(f"dtype={dtype!r} is not valid. Valid choices: float32, bfloat16, float16.")
    torch_dtype = TORCH_DTYPES[dtype]
    step = resolve_step_folder(checkpoint)
    role_dir = _check_step_folder(step, role)
    out = Path(os.path.expanduser(out_dir)).absolute()
    if out.exists() and not overwrite and not (out.is_dir() and not any(out.iterdir())):
        raise FileExistsError(f"{out} already exists and is not empty. Choose another output folder, "
                              "delete it, or pass overwrite=True (--overwrite).")
    if out.resolve() == step.resolve() or step.resolve() in out.resolve().parents:
        raise ExportError(f"Output folder {out} is inside the checkpoint {step}; choose a folder outside it.")

    config, trust = _role_config(step, role)
    auto_class = ROLE_CLASSES.get(role, "AutoModelForCausalLM")
    state = read_model_state(role_dir)
    adapter = (role_dir / lora.ADAPTER_CONFIG).is_file()
    if adapter_only and not adapter:
        raise ExportError(f"{role_dir} holds a whole model, not a LoRA adapter; export it without --adapter-only.")
    experts = {}  # a Megatron LoRA checkpoint's experts' adapters, merged here (peft cannot hold them)
    if convert.is_dist_checkpoint(role_dir):
        layout = convert.Layout.from_hf_config(config, value_head=role == "critic")
        # A LoRA run's checkpoint holds its adapters alone.
        adapters = {key: t for key, t in state.items() if megatron_lora.is_adapter_tensor(key)}
        experts = {key: t for key, t in adapters.items() if convert.is_expert(key)}
        if experts and adapter_only:
            raise ExportError(f"{role_dir} holds adapters of the experts, which transformers keeps as stacked tensors "
                              "that peft cannot adapt, so there is no peft adapter to write; export the merged model "
                              "(without --adapter-only).")
        try:
            state = {**convert.hf_state_from_dist_checkpoint({k: t for k, t in state.items() if k not in adapters},
                                                             layout),
                     **megatron_lora.hf_adapter_state(adapters, layout, lora.ADAPTER)}
        except ValueError as exc:
            raise ExportError(f"{role_dir}: {exc}") from None
    if adapter:
        from hybrid_rl.models import ModelPathError, resolve_model_path

        try:
            base = resolve_model_path(base_model or _stored_model_config(step, role).path,
                                      "--base-model" if base_model else f"the run's {MODEL_KEYS[role]}.path")
        except ModelPathError as exc:
            raise ExportError(f"{role_dir} holds a LoRA adapter, which needs its base model: {exc} Pass the "
                              "model folder the run trained from with --base-model.") from None
        peft_model = _with_adapter(state, role_dir, base, config, trust, auto_class)
        if not adapter_only:
            from peft import LoraConfig, PeftModel

            merged = peft_model.merge_and_unload() if isinstance(peft_model, PeftModel) else peft_model
            state = merged.state_dict()
            settings = LoraConfig.from_pretrained(str(role_dir))
            for name, delta in megatron_lora.expert_deltas(experts, settings.lora_alpha / settings.r).items():
                state[name] = state[name] + delta

    def write(tmp: Path) -> None:
        if adapter_only:
            peft_model.save_pretrained(str(tmp))
        else:
            save_hf_weights(state, config, tmp, auto_class, dtype=torch_dtype, trust_remote_code=trust,
                            source=role_dir)
        _copy_hf_files(step / HF_DIR, tmp)

    write_folder(out, write, overwrite)
    logger.info("Exported %s of %s to %s (%s)", role, step, out, dtype)
    return str(out)


def save_hf_weights(state: dict[str, torch.Tensor], config, folder: str | os.PathLike,
                    auto_class: str = "AutoModelForCausalLM", dtype: torch.dtype = torch.float32,
                    trust_remote_code: bool = False, source: str | os.PathLike = "the trainer") -> None:
    """Write full tensors `state` (as the trained module names them) with `config` as
    `config.json` + `model.safetensors` in `folder`, through the model class (`auto_class` of
    transformers), so tied weights and the architecture name come out as transformers and vLLM
    expect them."""
    model = _build_empty_model(config, auto_class, trust_remote_code)
    _load_into(model, state, Path(source))
    model = model.to(dtype)
    model.config.dtype = dtype
    model.eval()
    model.save_pretrained(str(folder), safe_serialization=True)


EXPORT_USAGE = """Export a hybrid-rl checkpoint as a Hugging Face model folder (safetensors).

    hybrid-rl-export checkpoints/my_run exported/my_run
    hybrid-rl-export checkpoints/my_run/global_step_40 exported/critic40 --role critic --dtype bfloat16
    hybrid-rl-export checkpoints/lora_run exported/lora_adapter --adapter-only

CHECKPOINT is a run folder (trainer.default_local_dir; its latest checkpoint is exported) or one of
its global_step_<N> folders. OUT_DIR gets config.json, model.safetensors, the tokenizer files, the
chat template and generation_config.json, and loads with transformers' from_pretrained or vLLM.
Only the model weights are read; the optimizer state is left on disk. A LoRA run's adapter is
merged into its base model, or written alone (--adapter-only) for peft's PeftModel.from_pretrained.
"""


def main(argv: list[str] | None = None) -> int:
    """The `hybrid-rl-export` command (and `tools/export_hf.py`)."""
    ap = argparse.ArgumentParser(prog="hybrid-rl-export", description=EXPORT_USAGE,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="run folder or global_step_<N> folder")
    ap.add_argument("out_dir", help="folder to write (must not exist or be empty, unless --overwrite)")
    ap.add_argument("--role", choices=ROLES, default="actor", help="actor (policy) or critic (value model)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                    help="dtype of the saved weights")
    ap.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it already exists")
    ap.add_argument("--adapter-only", action="store_true",
                    help="a LoRA run's checkpoint: write the adapter alone in peft's format (default: merged model)")
    ap.add_argument("--base-model", help="a LoRA run's base model folder (default: the run's actor_rollout_ref.model.path, "
                    "for --role critic its critic.model.path)")
    args = ap.parse_args(argv)

    try:
        step = resolve_step_folder(args.checkpoint)
        out = export_checkpoint(args.checkpoint, args.out_dir, role=args.role, dtype=args.dtype,
                                overwrite=args.overwrite, adapter_only=args.adapter_only, base_model=args.base_model)
    except (ValueError, OSError) as exc:  # clear messages from hybrid_rl.export; no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"exported {args.role} of {step} ({args.dtype}) to {out}:")
    for name in sorted(os.listdir(out)):
        print(f"  {name}  ({os.path.getsize(os.path.join(out, name)):,} bytes)")
    return 0
