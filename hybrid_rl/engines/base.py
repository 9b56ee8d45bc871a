"""The training-engine interface: what the workers may ask of one model (actor, reference or critic).

An engine owns a model and, when it is trained, its optimizer and learning-rate schedule. The
workers and the trainer see only this class, never FSDP or Megatron:

- `infer(batch, output, ...)`: log-probs (+ entropies), logits or values over a batch, in
  micro-batches of rows or of a token budget;
- `update(batch, loss_fn, ...)`: the PPO update of one training step, epochs x mini-batches of
  optimizer steps, every loss term normalised by the whole mini-batch's counts over all
  data-parallel ranks (`loss_fn` sees the model's outputs, never the model);
- `per_tensor_weights(dtype)`: full tensors with Hugging Face names, one at a time, for the
  rollout engine and for export;
- `save_checkpoint` / `load_checkpoint`: sharded model and optimizer plus this rank's schedule,
  RNG and skipped-step count, so a resume continues exactly;
- `load_weights_from(other)`: copy another engine's weights of the same model (a reference reset);
- `dp_rank` / `dp_size`: this rank's place among the data-parallel replicas.

On GPU an engine may keep its weights, optimizer state and (Megatron) gradient buffers in host
memory between uses (verl's `param_offload` / `optimizer_offload` / `grad_offload`): `resident()`
brings them to the GPU around each forward, update and checkpoint, so the rollout engine has the
memory the rest of the time.

A backend implements `forward_backward`, `optimizer_step`, `per_tensor_weights` and the sharded
half of the checkpoint; the mini-batch loop, micro-batching and metrics live here, once.
"""

from __future__ import annotations

import contextlib
import enum
import math
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from hybrid_rl import seqlen_balancing
from hybrid_rl.metrics import reduce_values
from hybrid_rl.protocol import Batch

FORWARD_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")
# A batch's table of the experts each token was routed to (mixture-of-experts router replay).
ROUTES_KEY = "routed_experts"
FORWARD_TOKENS = "update_tokens"  # reported as <role>/update_tokens, per rank


class Output(enum.Enum):
    """What a forward pass returns, per response token, (B, T) unless noted."""

    LOG_PROBS = "log_probs"  # {"log_probs"}
    LOG_PROBS_ENTROPY = "log_probs_entropy"  # {"log_probs", "entropy"}
    # {"log_probs", "sum_pi_squared"}: Σ_v π_v² of each next-token distribution too (no gradient)
    LOG_PROBS_SUM_PI_SQUARED = "log_probs_sum_pi_squared"
    LOGITS = "logits"  # {"logits"}: (B, T, V) float32, divided by the temperature
    # {"top_log_probs", "top_ids"}: (B, T, k) the k most likely next tokens' log-probs and ids (k: ModelSpec.top_k)
    TOP_LOG_PROBS = "top_log_probs"
    VALUES = "values"  # {"values"}: V(s_t), read at the position before each response token
    SCORES = "scores"  # {"scores"}: (B,) a reward model's score, read at each row's last real token
    TOKEN_SCORES = "token_scores"  # {"token_scores"}: a process reward model's score at each response token


class Head(enum.Enum):
    """What sits on top of the backbone."""

    LM = "lm"  # the language-model head: the actor and the reference policy
    VALUE = "value"  # a scalar on every position (token classification): the critic
    SCORE = "score"  # a scalar read at the last token (sequence classification): a reward model
    STEP_SCORE = "step_score"  # a score at every token (token classification): a process reward model
    STEP_TAG = "step_tag"  # P(good) from the LM head's logits of two tokens, at every token: a step-tag scorer


# The transformers class of a model with each head, as `save_hf_model` writes it.
HEAD_CLASSES = {Head.LM: "AutoModelForCausalLM", Head.VALUE: "AutoModelForTokenClassification",
                Head.SCORE: "AutoModelForSequenceClassification", Head.STEP_SCORE: "AutoModelForTokenClassification",
                Head.STEP_TAG: "AutoModelForCausalLM"}


# What a checkpoint of a trained engine holds (verl's names): the weights, the optimizer state, and
# the rest (schedule, RNG states, skipped-step count).
CHECKPOINT_PARTS = ("model", "optimizer", "extra")

# Each role's own section and its model's section in the config.
# A distillation teacher runs with the reference policy's settings.
ROLE_KEYS = {"actor": "actor_rollout_ref.actor", "ref": "actor_rollout_ref.ref", "teacher": "actor_rollout_ref.ref",
             "critic": "critic", "reward_model": "reward_model"}
MODEL_KEYS = {"actor": "actor_rollout_ref.model", "ref": "actor_rollout_ref.model",
              "teacher": "actor_rollout_ref.model", "critic": "critic.model", "reward_model": "reward_model.model"}


@dataclass(frozen=True)
class ModelSpec:
    """Which model an engine builds and whether it trains it."""

    role: str  # actor, ref, critic or reward_model: names metrics and errors
    path: str  # local Hugging Face folder
    model_cfg: Any  # actor_rollout_ref.model, critic.model or reward_model.model
    head: Head = Head.LM
    optim_cfg: Any = None  # None: frozen (the reference policy)
    total_steps: int = 1  # for the learning-rate schedule
    tag_token_ids: tuple[int, int] | None = None  # Head.STEP_TAG: the (good, bad) token ids
    top_k: int = 0  # Output.TOP_LOG_PROBS: how many of each next-token distribution's most likely tokens

    @property
    def model_key(self) -> str:
        """Where `model_cfg` sits in the config, for error messages."""
        return MODEL_KEYS[self.role]

    @property
    def role_key(self) -> str:
        """Where the role's own section (strategy, optim, fsdp_config, megatron) sits in the config."""
        return ROLE_KEYS[self.role]


# loss_fn(outputs, micro, agg_kwargs) -> (loss, {metric: float}); see `TrainEngine.update`.
LossFn = Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor], dict], tuple[torch.Tensor, dict[str, float]]]


class TrainEngine(ABC):
    spec: ModelSpec
    device: torch.device
    scheduler: Any = None  # torch LR scheduler of a trained model
    skipped_steps: int = 0  # optimizer steps skipped for a non-finite gradient norm
    share_prompts: bool = False  # micro-batches keep a prompt's responses together (one prompt copy)
    sequence_parallel_size: int = 1  # ranks that split each micro-batch's tokens (FSDP's Ulysses groups)
    offload_params: bool = False  # the weights wait in host memory between uses (GPU)
    offload_optimizer: bool = False  # so does the optimizer state between updates (GPU)
    offload_grads: bool = False  # the gradient buffers are freed between updates (GPU, Megatron)
    route_replay: Any = None  # the engine's router replay, where the role sets router_replay.mode
    pending_save: Any = None  # the Future of a checkpoint being written in the background

    # ------------------------------------------------------------------ what a backend implements
    @property
    @abstractmethod
    def dp_rank(self) -> int: ...

    @property
    @abstractmethod
    def dp_size(self) -> int: ...

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The data-parallel ranks' process group (None: every rank)."""
        return None

    @property
    def is_output_rank(self) -> bool:
        """Whether this rank's results stand for its data-parallel replica (one rank per replica;
        the other ranks of a model-parallel replica compute the same rows)."""
        return True

    @abstractmethod
    def forward_backward(self, micros: list[dict[str, torch.Tensor]], output: Output, temperature: float,
                         loss_fn: Callable | None = None) -> list[dict]:
        """Run `micros` through the model. Without `loss_fn`: no gradients, returns each
        micro-batch's outputs. With it: `loss_fn(outputs, micro) -> (loss, terms)` per
        micro-batch, backward of every loss (gradients accumulate), returns each one's terms."""

    @abstractmethod
    def optimizer_step(self, grad_clip: float) -> float:
        """Clip by the global gradient norm, step unless it is non-finite, zero the gradients;
        returns the pre-clip norm."""

    @abstractmethod
    def per_tensor_weights(self, dtype: torch.dtype | None,
                           only_trained: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight as a full tensor with its Hugging Face name, cast to `dtype` (None: as
        gathered, float32 masters on FSDP), one at a time. A collective: every rank iterates to
        the end in the same order. With `only_trained`, only the weights training can change
        (under LoRA the adapted ones, merged; otherwise all)."""

    @abstractmethod
    def num_params(self) -> int: ...

    @abstractmethod
    def _save_sharded(self, folder: str, background: bool = False) -> None:
        """Write this rank's shards of the model and optimizer into `folder`; with `background`,
        copy them to host memory and set `pending_save` to the Future of their write."""

    @abstractmethod
    def _load_sharded(self, folder: str, optimizer: bool) -> None:
        """Read this rank's shards of the model, and of the optimizer with `optimizer`, from `folder`."""

    def local_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, this rank's shard) of every parameter, for `load_weights_from`."""
        raise NotImplementedError(f"The {type(self).__name__} cannot copy weights between engines yet (the "
                                  "reference reset of trainer.iterative); use strategy=fsdp.")

    def _place(self, resident: bool, params: bool, optimizer: bool, grads: bool) -> None:
        """Bring the weights / optimizer state / gradient buffers named to the compute device
        (`resident`) or send them to host memory (for `resident()`)."""
        raise NotImplementedError(f"The {type(self).__name__} cannot offload to host memory yet.")

    @property
    def has_adapter(self) -> bool:
        """Whether the model trains a LoRA adapter (then `adapter_disabled` gives the base model)."""
        return False

    def adapter_disabled(self) -> contextlib.AbstractContextManager:
        """Forward passes inside compute the model without its LoRA adapter (see `lora.AdapterDisabled`)."""
        raise NotImplementedError(f"The {type(self).__name__} has no LoRA adapter to disable.")

    def recording_routes(self) -> contextlib.AbstractContextManager:
        """Forward-only passes inside also return the experts each token was routed to
        (`ROUTES_KEY`, see `hybrid_rl.engines.routing`), for an update to replay."""
        if self.route_replay is None:
            raise NotImplementedError(f"The {type(self).__name__} records mixture-of-experts routes only where the "
                                      "role sets router_replay.mode.")
        return self.route_replay.record()

    def pass_metrics(self) -> dict[str, float]:
        """Figures of the last training pass the engine measures itself (one mini-batch's): the
        share of replayed routes the router would have chosen otherwise."""
        changed = None if self.route_replay is None else self.route_replay.changed_share
        return {} if changed is None else {"routes_changed": changed}

    def hf_module(self) -> torch.nn.Module:
        """The model as a `transformers` module, for `rollout.name=hf`."""
        raise NotImplementedError(f"The {type(self).__name__} has no transformers module to generate with; "
                                  "use actor_rollout_ref.rollout.name=vllm.")

    # ------------------------------------------------------------------ shared by every backend
    def micro_batches(self, batch: Batch, micro_rows: int, max_tokens: int | None) -> list[torch.Tensor]:
        """Row indices of micro-batches of `micro_rows` rows, or (with `max_tokens`, i.e.
        `use_dynamic_bsz`) of at most about that many tokens per rank, balanced (a sequence-parallel
        group splits each micro-batch's tokens over its ranks, as verl's budget does). Every
        data-parallel rank then runs as many micro-batches as the one that needs most: each
        forward is a collective."""
        if max_tokens is None:
            return list(torch.arange(len(batch)).split(micro_rows))
        max_tokens *= self.sequence_parallel_size
        count = seqlen_balancing.token_budget_bins(batch, max_tokens, self.share_prompts)
        count = int(all_reduce_scalar(count, self.device, op=dist.ReduceOp.MAX, group=self.dp_group))
        return seqlen_balancing.split_into(batch, count, self.share_prompts)

    @contextlib.contextmanager
    def resident(self, optimizer: bool = False):
        """The offloaded weights (with `optimizer`, also the offloaded optimizer state and
        gradient buffers) on the compute device inside the block, back in host memory after it."""
        parts = (self.offload_params, optimizer and self.offload_optimizer, optimizer and self.offload_grads)
        if not any(parts):
            yield
            return
        self._place(True, *parts)
        try:
            yield
        finally:
            self._place(False, *parts)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # the memory goes back to the rollout engine

    def _to_device(self, part: Batch, keys) -> dict[str, torch.Tensor]:
        return {k: part[k].to(self.device) for k in keys}

    @torch.no_grad()
    def infer(self, batch: Batch, output: Output, temperature: float, micro_rows: int,
              max_tokens: int | None) -> dict[str, torch.Tensor]:
        """`output` for every row of `batch`, on the CPU, in micro-batches of `micro_rows` rows
        or `max_tokens` tokens."""
        groups = self.micro_batches(batch, micro_rows, max_tokens)
        keys = FORWARD_KEYS + ((ROUTES_KEY,) if ROUTES_KEY in batch else ())  # routes to replay
        with self.resident():
            results = self.forward_backward([self._to_device(batch[rows], keys) for rows in groups],
                                            output, temperature)
        out: dict[str, torch.Tensor] = {}
        for rows, result in zip(groups, results):
            for key, value in result.items():
                if key not in out:  # outputs in float32, recorded routes as they are
                    dtype = torch.float32 if value.is_floating_point() else value.dtype
                    out[key] = torch.zeros((len(batch), *value.shape[1:]), dtype=dtype)
                out[key][rows] = value.cpu().to(out[key].dtype)
        return out

    def update(self, batch: Batch, role_cfg: Any, *, rollout_n: int, seed: int, output: Output,
               temperature: float, loss_fn: LossFn, after_step: Callable[[], Any] | None = None) -> dict[str, float]:
        """One training step's update: `role_cfg.ppo_epochs` passes over mini-batches of
        `ppo_mini_batch_size` prompts x `rollout_n` responses (split over the data-parallel
        ranks), each an optimizer step with gradients accumulated over micro-batches
        (`ppo_micro_batch_size_per_gpu` rows, or `ppo_max_token_len_per_gpu` tokens with
        `use_dynamic_bsz`), then one scheduler step.

        Before each mini-batch the token and sequence counts are all-reduced, and
        `loss_fn(outputs, micro, agg_kwargs) -> (loss, terms)` normalises by them, so the
        accumulated gradient (averaged over ranks) is exactly that of the whole mini-batch.
        `terms` are floats weighted the same way: their sum over micro-batches, averaged over
        ranks, is the exact mini-batch value. Returns `<role>/<metric>` means over mini-batches
        (max for *_max, the total for the token count), plus grad_norm, lr, skipped_steps and what
        the engine measures of each pass itself (`pass_metrics`). `after_step` is called after
        each optimizer step (a profiler's schedule counts them).
        """
        role = self.spec.role
        mini_rows = role_cfg.ppo_mini_batch_size * rollout_n // self.dp_size
        max_tokens = role_cfg.ppo_max_token_len_per_gpu if role_cfg.use_dynamic_bsz else None
        metrics: dict[str, list[float]] = {}
        generator = torch.Generator().manual_seed(seed)
        with self.resident(optimizer=True):
            for _ in range(role_cfg.ppo_epochs):
                epoch = batch[torch.randperm(len(batch), generator=generator)] if role_cfg.shuffle else batch
                for mini in epoch.split(mini_rows):
                    mask = mini["response_mask"]
                    agg_kwargs = {
                        "global_num_tokens": all_reduce_scalar(float(mask.sum()), self.device, group=self.dp_group),
                        "global_num_seqs": all_reduce_scalar(float((mask.sum(-1) > 0).sum()), self.device,
                                                             group=self.dp_group),
                        "dp_size": self.dp_size,
                    }
                    parts = [mini[rows] for rows in self.micro_batches(mini, role_cfg.ppo_micro_batch_size_per_gpu,
                                                                        max_tokens)]
                    micros = [self._to_device(part, part.tensors.keys()) for part in parts]
                    terms = self.forward_backward(micros, output, temperature,
                                                  lambda out, micro: loss_fn(out, micro, agg_kwargs))
                    sums: dict[str, float] = {}
                    for micro_terms in terms:
                        for key, value in micro_terms.items():
                            sums[key] = combine_metric(key, sums.get(key), value)
                    sums.update(self.pass_metrics())
                    sums["grad_norm"] = self.optimizer_step(role_cfg.grad_clip)
                    if after_step is not None:
                        after_step()
                    sums[FORWARD_TOKENS] = sum(sum(seqlen_balancing.cost_units(part, self.share_prompts)[1])
                                               for part in parts)
                    for key, value in sums.items():
                        metrics.setdefault(key, []).append(value)
        self.scheduler.step()
        out = {(key if "/" in key else f"{role}/{key}"): summarise(key, values) for key, values in metrics.items()}
        out[f"{role}/lr"] = self.scheduler.get_last_lr()[0]
        out[f"{role}/skipped_steps"] = float(self.skipped_steps)
        return out

    @torch.no_grad()
    def load_weights_from(self, other: TrainEngine) -> None:
        """Copy `other`'s weights into this model, shard by shard: the same model with the same
        layout (the reference reset of iterative RL, from the actor)."""
        mine, theirs = dict(self.local_parameters()), dict(other.local_parameters())
        if mine.keys() != theirs.keys():
            raise ValueError(f"{self.spec.role} and {other.spec.role} hold different models; weights copy only "
                             "between engines of the same model.")
        for name, shard in mine.items():
            shard.copy_(theirs[name])

    def save_checkpoint(self, folder: str, background: bool = False) -> None:
        """This rank's shards plus its scheduler, RNG states and skipped-step count; everything
        loads back with `weights_only` loading. With `background` (verl's `checkpoint.async_save`)
        the shards are copied to host memory here and written while training goes on;
        `finish_checkpoint` waits for them."""
        self.finish_checkpoint()
        os.makedirs(folder, exist_ok=True)
        with self.resident(optimizer=True):
            self._save_sharded(folder, background)
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        scheduler = self.scheduler.state_dict() if self.scheduler is not None else None
        torch.save({"scheduler": scheduler, "rng": rng, "skipped_steps": self.skipped_steps}, _extra_path(folder))

    def finish_checkpoint(self) -> None:
        """Wait until the shards of a background save are written (raising what the write raised)."""
        pending, self.pending_save = self.pending_save, None
        if pending is not None:
            pending.result()

    def load_checkpoint(self, folder: str, parts: tuple[str, ...] = CHECKPOINT_PARTS) -> None:
        """Inverse of `save_checkpoint` (same world size and layout), or only the `parts` of it
        named (verl's `checkpoint.load_contents`; `model` always): without `optimizer` the
        optimizer state stays as built, without `extra` the schedule, RNG states and skipped-step
        count do."""
        with self.resident(optimizer=True):
            self._load_sharded(folder, optimizer="optimizer" in parts)
        if "extra" not in parts:
            return
        extra = torch.load(_extra_path(folder), weights_only=True)
        if self.scheduler is not None:
            self.scheduler.load_state_dict(extra["scheduler"])
        torch.set_rng_state(extra["rng"]["cpu"])
        if "cuda" in extra["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state(extra["rng"]["cuda"])
        self.skipped_steps = int(extra.get("skipped_steps", 0))

    def save_hf_model(self, folder: str, config) -> None:
        """The whole model as a Hugging Face folder (float32 safetensors + `config`), written by
        rank 0 from `per_tensor_weights`. Every rank must call it."""
        from hybrid_rl.export import save_hf_weights

        weights = self.per_tensor_weights(torch.float32)
        if dist.is_initialized() and dist.get_rank() != 0:
            for _ in weights:  # gathering each tensor is a collective
                pass
            return
        save_hf_weights({name: tensor.cpu() for name, tensor in weights}, config, folder, HEAD_CLASSES[self.spec.head])

def _extra_path(folder: str) -> str:
    """This rank's file of non-tensor checkpoint state."""
    return os.path.join(folder, f"extra_rank{dist.get_rank() if dist.is_initialized() else 0}.pt")


def all_reduce_scalar(value: float, device: torch.device, op=dist.ReduceOp.SUM, group=None) -> float:
    """`value` reduced over `group` (None: every rank)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op, group=group)
    return float(t.item())


def combine_metric(key: str, total: float | None, value: float) -> float:
    """Metrics named *_max combine by max, *_min by min, all others by sum."""
    if total is None:
        return value
    if key.endswith("_max"):
        return max(total, value)
    return min(total, value) if key.endswith("_min") else total + value


def summarise(key: str, values: list[float]) -> float:
    """One value from per-mini-batch values: the total for the token count, else as ranks' values
    are reduced (`metrics.reduce_values`)."""
    if key == FORWARD_TOKENS:
        return float(sum(values))
    return reduce_values(key, values)


def token_share(mask: torch.Tensor, agg_kwargs: dict) -> float:
    """Weight of a micro-batch's per-token means in the exact mini-batch mean (see
    `TrainEngine.update`)."""
    return float(mask.sum()) / max(agg_kwargs["global_num_tokens"], 1.0) * agg_kwargs["dp_size"]


def lr_lambda(optim_cfg: Any, total_steps: int):
    """Warmup then constant or cosine decay, as a multiplier of the base learning rate, counted as
    verl counts it: the first update is step 0, so a warmup starts at 0. `zero_indexed_step=false`
    (torchtitan's count, from 1) shifts the cosine schedule by one step, as in verl, whose constant
    schedule counts from 0 either way."""
    warmup = optim_cfg.lr_warmup_steps
    if warmup is None or warmup < 0:
        warmup = int(optim_cfg.lr_warmup_steps_ratio * total_steps)
    kind = optim_cfg.lr_scheduler_type
    min_ratio = optim_cfg.min_lr_ratio or 0.0
    cycles = optim_cfg.num_cycles
    shift = 0 if kind == "constant" or optim_cfg.get("zero_indexed_step", True) else 1

    def factor(step: int) -> float:
        step += shift
        if step < warmup:
            return step / warmup
        if kind == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total_steps - warmup)
        cosine = 0.5 * (1.0 + math.cos(2.0 * math.pi * cycles * progress))
        return max(min_ratio, min_ratio + (1.0 - min_ratio) * cosine)

    return factor
