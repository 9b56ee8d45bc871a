"""Rollout traces (verl's ``actor_rollout_ref.rollout.trace.*``): what the model was given and
wrote, turn by turn, and what its tools answered, as MLflow traces to read in MLflow's UI.

``trace.backend=mlflow`` turns them on (verl's other backends, weave and trackio, are refused at
start). Each rank's worker traces its own rows, training and validation: all of them, or with
``trace.max_samples_per_step_per_worker`` = k the responses of k of its prompts per call, drawn
from (seed, step, rank). One trace per response, as in verl: a root span ``rollout_trace`` tagged
``step``, ``sample_index`` (the row's ``extra_info.index``, else its prompt's place in the batch),
``rollout_n`` (which of the prompt's responses), ``validate`` and ``experiment_name``; under it a
``generate`` span per engine call (the context's token ids in, the sampled ids and their
log-probs out; the engine generates a batch at once, so the span has the batch's times) and, in
multi-turn rollouts, a ``tool <name>`` span per call (the arguments in; text, reward and error
flag out). ``trace.token2text`` adds the decoded text of each token list. The store is
``MLFLOW_TRACKING_URI`` when set, else the run folder's ``mlflow.db`` (the mlflow logger's);
the experiment is ``trace.project_name``.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

from hybrid_rl.protocol import Batch

BACKENDS = ("mlflow",)
ROOT_SPAN = "rollout_trace"


@dataclass
class Span:
    """One traced operation of a trajectory: ``name`` is ``generate`` (``tokens``: the range of
    the trajectory's tokens it sampled) or ``tool <name>`` (``inputs``/``outputs``: the call)."""

    name: str
    start_ns: int
    end_ns: int
    tokens: tuple[int, int] | None = None
    inputs: Any = None
    outputs: Any = None


def now_ns() -> int:
    return time.time_ns()


class RolloutTracer:
    """Writes one rank's traces; built in its worker when ``trace.backend`` is set."""

    def __init__(self, cfg: Any, tokenizer, rank: int):
        import mlflow

        from hybrid_rl.tracking import mlflow_experiment

        trace = cfg.actor_rollout_ref.rollout.trace
        self.mlflow = mlflow
        self.experiment_id = mlflow_experiment(trace.project_name or "hybrid_rl", cfg.trainer.default_local_dir)
        self.experiment_name = str(trace.experiment_name)
        self.token2text = bool(trace.token2text)
        self.max_prompts = trace.max_samples_per_step_per_worker
        self.tokenizer = tokenizer
        self.seed, self.rank = int(cfg.trainer.seed), rank

    def traced_rows(self, prompts: Batch) -> list[tuple[int, Any, int]]:
        """(row, sample index, rollout number) of the rows to trace."""
        infos = prompts["extra_info"] if "extra_info" in prompts.non_tensors else [None] * len(prompts)
        groups = prompts["uid"] if "uid" in prompts.non_tensors else list(range(len(prompts)))
        places = {group: place for place, group in enumerate(dict.fromkeys(groups))}  # prompts in batch order
        rows, seen = [], dict.fromkeys(places, 0)
        for row, (group, info) in enumerate(zip(groups, infos)):
            index = info.get("index") if isinstance(info, dict) and info.get("index") is not None else places[group]
            rows.append((row, group, index, seen[group]))
            seen[group] += 1
        if self.max_prompts is not None and len(places) > self.max_prompts:
            draw = random.Random(hash((self.seed, prompts.meta.step, self.rank)))
            chosen = set(draw.sample(list(places), self.max_prompts))
            rows = [r for r in rows if r[1] in chosen]
        return [(row, index, rollout_n) for row, _, index, rollout_n in rows]

    def log(self, prompts: Batch, prompt_ids: list[list[int]], tokens: list[list[int]],
            log_probs: list[list[float]], spans: list[list[Span]], validate: bool) -> None:
        """Write the traces of ``prompts``' traced rows: ``tokens`` / ``log_probs`` each row's
        response as sampled (tool turns included), ``spans`` its operations."""
        for row, index, rollout_n in self.traced_rows(prompts):
            first, last = spans[row][0], spans[row][-1]
            tags = {"step": str(prompts.meta.step), "sample_index": str(index), "rollout_n": str(rollout_n),
                    "validate": str(validate), "experiment_name": self.experiment_name}
            root = self.mlflow.start_span_no_context(
                ROOT_SPAN, span_type="AGENT", inputs=self._ids("prompt", prompt_ids[row]), tags=tags,
                experiment_id=self.experiment_id, start_time_ns=first.start_ns)
            for span in spans[row]:
                if span.tokens is not None:
                    lo, hi = span.tokens
                    inputs = self._ids("prompt", prompt_ids[row] + tokens[row][:lo])
                    outputs = {**self._ids("token", tokens[row][lo:hi]), "log_probs": log_probs[row][lo:hi]}
                    span_type = "LLM"
                else:
                    inputs, outputs, span_type = span.inputs, span.outputs, "TOOL"
                child = self.mlflow.start_span_no_context(span.name, span_type=span_type, parent_span=root,
                                                          inputs=inputs, start_time_ns=span.start_ns)
                child.end(outputs=outputs, end_time_ns=span.end_ns)
            root.end(outputs=self._ids("response", tokens[row]), end_time_ns=last.end_ns)
        # MLflow exports in the background; a worker may be stopped without running its exit hooks.
        self.mlflow.flush_trace_async_logging(terminate=False)

    def _ids(self, name: str, ids: list[int]) -> dict:
        out = {f"{name}_ids": list(ids)}
        if self.token2text:
            out[f"{name}_text"] = self.tokenizer.decode(ids, skip_special_tokens=False)
        return out


def rollout_tracer(cfg: Any, tokenizer, engine) -> RolloutTracer | None:
    """The tracer of this rank's rollout ``engine`` (``rollout.trace.backend``), else None; of a
    tensor-parallel group, whose ranks generate the same rows, only the first rank traces."""
    if cfg.actor_rollout_ref.rollout.trace.backend is None or not getattr(engine, "is_output_rank", True):
        return None
    return RolloutTracer(cfg, tokenizer, engine.dp_rank)
