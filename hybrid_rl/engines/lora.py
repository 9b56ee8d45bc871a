"""LoRA on the FSDP engine, with `peft` and verl's keys (`actor_rollout_ref.model.lora_rank`,
`lora_alpha`, `target_modules`, `exclude_modules`, `lora_adapter_path`; the critic's under
`critic.model`).

peft injects the adapter into the `transformers` model in place: the engine trains that model
(only the adapter's tensors require gradients, so the optimizer holds only them) and keeps the
`PeftModel` wrapper for what peft does well: switching the adapter off, which makes the frozen
base model the reference policy without a second copy (`AdapterDisabled`), and writing the
adapter in its own format for export.

The rollout engine and the Hugging Face export get merged weights under the base model's names,
W + scaling * B A, one tensor at a time (`merged_weights`); after the first sync only the merged
target weights change, so only they are pushed.

A critic's value head is new (drawn at random when the engine starts), so LoRA cannot stand in
for training it: the critic is peft's token classifier, whose head (`score`) is trained whole
beside the backbone's adapters (peft's `modules_to_save`) and saved with them.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

ADAPTER = "default"  # peft's name for the one adapter
LORA_TENSORS = (f".lora_A.{ADAPTER}.", f".lora_B.{ADAPTER}.")
BASE_LAYER = ".base_layer."
ADAPTER_CONFIG = "adapter_config.json"  # peft's file name, written next to an engine's checkpoint
VALUE_HEAD = "score"  # the critic's head in transformers' token classifiers
# What peft adds to a classifier's modules_to_save and trains whole (pre_classifier, DistilBERT's, since peft 0.22).
HEAD_MODULES = ("classifier", VALUE_HEAD, "pre_classifier")
# peft's two copies of a module it trains whole: the trained one and the original, kept frozen.
TRAINED_COPY, FROZEN_COPY = f".modules_to_save.{ADAPTER}.", ".original_module."


def enabled(model_cfg: Any) -> bool:
    """LoRA is on when `lora_rank` > 0 or an adapter is given to start from."""
    return int(model_cfg.get("lora_rank", 0) or 0) > 0 or bool(model_cfg.get("lora_adapter_path"))


def lora_config(model_cfg: Any, value_head: bool = False):
    """peft's `LoraConfig` from verl's keys (`target_modules` a module-name list or `all-linear`,
    every linear layer but the LM head). With `value_head`, a token classifier's: its head is
    trained whole, not adapted."""
    from omegaconf import OmegaConf
    from peft import LoraConfig

    def plain(value):
        return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value

    config = LoraConfig(r=int(model_cfg.lora_rank), lora_alpha=float(model_cfg.lora_alpha),
                        target_modules=plain(model_cfg.target_modules),
                        exclude_modules=plain(model_cfg.exclude_modules), lora_dropout=0.0, bias="none",
                        task_type="CAUSAL_LM")
    return as_value_model(config) if value_head else config


def as_value_model(config):
    """`config` (a `LoraConfig`) for a critic: peft's token-classification task, which trains the
    head whole (`modules_to_save`), and the head left out of the adapted layers (`all-linear`
    takes every linear layer of a model without an LM head, the head included)."""
    config.task_type = "TOKEN_CLS"
    excluded = config.exclude_modules
    if isinstance(excluded, str):  # peft: a regular expression over module names
        config.exclude_modules = f"(?:{excluded})|{VALUE_HEAD}"
    else:
        config.exclude_modules = {*(excluded or ()), VALUE_HEAD}
    return config


def attach(model: torch.nn.Module, model_cfg: Any, autocast: bool = False, key: str = "actor_rollout_ref.model",
           value_head: bool = False):
    """Inject a new adapter (or the one at `lora_adapter_path`, trainable) into `model`; returns
    the `PeftModel`. Its `get_base_model()` is `model` itself, adapter layers included. `key` is
    where `model_cfg` sits in the config (for errors); `value_head`: `model` is a critic, whose
    head trains whole (an adapter folder of the policy starts its backbone, the head as loaded).

    Under `autocast` (bf16 on CPU) the adapter's matmuls cast their inputs to bf16 anyway, so
    peft's own cast of each adapted layer's input to the adapter's float32 is skipped: the same
    log-probs, bit for bit, and a 3-5 % faster forward of the 135M model."""
    from peft import PeftModel, get_peft_model

    path = model_cfg.get("lora_adapter_path")
    unfit = []
    try:
        if path and value_head:
            peft_model, unfit = _value_model_from_adapter(model, path)
        elif path:
            peft_model = PeftModel.from_pretrained(model, path, is_trainable=True)
        else:
            peft_model = get_peft_model(model, lora_config(model_cfg, value_head))
    except ValueError as exc:  # peft: "Target modules {...} not found in the base model"
        names = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                        if isinstance(m, torch.nn.Linear)})
        raise ValueError(f"{key}.target_modules={model_cfg.target_modules!r} / exclude_modules="
                         f"{model_cfg.exclude_modules!r} leave no layer to adapt in {type(model).__name__} "
                         f"({exc}). Its linear layers are named {names}; or use all-linear.") from None
    except OSError as exc:
        raise ValueError(f"{key}.lora_adapter_path={path!r} is not a peft adapter folder (adapter_config.json + "
                         f"adapter_model.safetensors): {exc}") from None
    if unfit:
        raise ValueError(f"{key}.lora_adapter_path={path!r} holds tensors {type(model).__name__} has no place for "
                         f"(e.g. {unfit[:3]}): it is an adapter of another model.")
    if autocast:
        from peft.tuners.lora import LoraLayer

        for layer in (m for m in model.modules() if isinstance(m, LoraLayer)):
            layer.cast_input_dtype_enabled = False
    config = peft_model.peft_config[ADAPTER]
    heads = set(HEAD_MODULES) if value_head else set()
    if getattr(config, "use_dora", False) or set(getattr(config, "modules_to_save", None) or ()) - heads:
        raise ValueError(f"{key}.lora_adapter_path={path!r}: DoRA adapters and modules_to_save (other than a "
                         "critic's head) are not supported; use a plain LoRA adapter.")
    return peft_model


def _value_model_from_adapter(model: torch.nn.Module, path: str):
    """A critic (token classifier) with the adapter at `path`, trainable: a critic's own (with
    its head), or a policy's, which starts the backbone while the critic keeps its head. Returns
    it and the adapter's tensors that fit nowhere in it."""
    from peft import LoraConfig, get_peft_model
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    tensors = load_peft_weights(path, device="cpu")
    for name, tensor in getattr(model, VALUE_HEAD).state_dict().items():
        tensors.setdefault(f"base_model.model.{VALUE_HEAD}.{name}", tensor.clone())
    config = as_value_model(LoraConfig.from_pretrained(path))
    config.inference_mode = False  # saved as true; here it trains
    peft_model = get_peft_model(model, config)
    return peft_model, set_peft_model_state_dict(peft_model, tensors).unexpected_keys


def is_adapter_tensor(name: str) -> bool:
    return any(part in name for part in LORA_TENSORS)


def is_trained_tensor(name: str) -> bool:
    """A tensor a LoRA checkpoint holds: the adapter's, or a critic's head (trained whole)."""
    return is_adapter_tensor(name) or TRAINED_COPY in name


def merged_weights(state: dict[str, Any], scalings: dict[str, float], full: Callable[[Any], torch.Tensor],
                   only_adapted: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(base-model name, full tensor) for every weight of the model whose `state` dict has
    adapters injected: an adapted layer's weight is W + scaling * B A (float32 math), its other
    tensors and every other layer's come as they are. `full` turns a (possibly sharded) entry
    into a full tensor; `scalings` maps each adapted layer's name to its scaling; a head trained
    whole comes under its own name. With `only_adapted`, only what training changes: the
    adapted weights (and a trained head)."""
    for name, tensor in state.items():
        if is_adapter_tensor(name) or FROZEN_COPY in name:
            continue
        if TRAINED_COPY in name:
            yield name.replace(TRAINED_COPY, "."), full(tensor)
            continue
        layer, in_adapted_layer, param = name.partition(BASE_LAYER)
        if not in_adapted_layer or param != "weight":  # frozen: other layers, an adapted layer's bias
            if not only_adapted:
                yield (f"{layer}.{param}" if in_adapted_layer else name), full(tensor)
            continue
        a = full(state[f"{layer}.lora_A.{ADAPTER}.weight"]).float()
        b = full(state[f"{layer}.lora_B.{ADAPTER}.weight"]).float()
        yield f"{layer}.weight", torch.addmm(full(tensor).float(), b, a, alpha=scalings[layer])


def scalings(peft_model) -> dict[str, float]:
    """Each adapted layer's scaling (lora_alpha / r, or / sqrt(r) with rsLoRA), by its name in
    the base model."""
    from peft.tuners.lora import LoraLayer

    base = peft_model.get_base_model()
    return {name: float(module.scaling[ADAPTER]) for name, module in base.named_modules()
            if isinstance(module, LoraLayer)}


class AdapterDisabled:
    """The reference policy of a LoRA run: the actor's engine with its adapter switched off, so
    the frozen base model is computed with no second copy in memory. Offers what the worker asks
    of a reference: `infer`, `forward_backward` (the full KL's logits), `resident` and the
    engine's data-parallel layout."""

    def __init__(self, engine):
        self.engine = engine

    @property
    def dp_rank(self) -> int:
        return self.engine.dp_rank

    @property
    def dp_size(self) -> int:
        return self.engine.dp_size

    @property
    def is_output_rank(self) -> bool:
        return self.engine.is_output_rank

    def infer(self, *args, **kwargs):
        with self.engine.adapter_disabled():
            return self.engine.infer(*args, **kwargs)

    def forward_backward(self, *args, **kwargs):
        with self.engine.adapter_disabled():
            return self.engine.forward_backward(*args, **kwargs)

    def resident(self) -> contextlib.AbstractContextManager:
        return self.engine.resident()
