"""Prompt dataset for RL training in verl's data schema.

Each row has ``prompt`` (chat messages ``[{"role", "content"}]`` or a plain
string), ``data_source`` (selects the reward function), ``reward_model``
(``{"style": "rule", "ground_truth": str}``) and optionally ``extra_info``.
Prompts are rendered with the tokenizer's chat template (with the generation
prompt appended) and tokenised once, when the dataset is built.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from hybrid_rl.protocol import Batch

logger = logging.getLogger(__name__)

__all__ = ["RLDataset", "collate_prompts", "custom_rows", "read_rows"]

TRUNCATION_MODES = ("error", "left", "right", "middle")
_PARQUET_EXT = (".parquet",)
_JSON_EXT = (".jsonl", ".json")


# --------------------------------------------------------------------------- reading
def _read_parquet(path: str) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid/OSError on corrupt files
        raise ValueError(
            f"cannot read parquet file {path}: {type(exc).__name__}: {str(exc).rstrip('.')}. "
            "The file is corrupt or not parquet; regenerate it (e.g. tools/data/arithmetic.py)."
        ) from exc
    return table.to_pylist()


def _read_json(path: str) -> list[dict]:
    rows: list[dict] = []
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read JSON file {path}: {type(exc).__name__}: {exc}") from exc
    stripped = text.lstrip()
    if stripped.startswith("["):  # tolerate a single JSON array of objects
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise ValueError(f"cannot parse JSON file {path}: {exc}") from exc
        rows = list(data)
    else:
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"cannot parse JSON Lines file {path} at line {lineno}: {exc}. "
                    "Each line must be one JSON object."
                ) from exc
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(
                f"{path}: record {i} is a {type(row).__name__}, expected a JSON object per line"
            )
    return rows


def read_rows(files: str | os.PathLike | Sequence[str | os.PathLike]) -> list[dict]:
    """Read and concatenate the rows of parquet / JSON Lines files."""
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    files = [os.path.expanduser(str(f)) for f in files]
    if not files:
        raise ValueError("no data files given; set data.train_files / data.val_files")
    rows: list[dict] = []
    for path in files:
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"data file not found: {path}. Check data.train_files / data.val_files "
                "(e.g. run tools/data/arithmetic.py to create the arithmetic data)."
            )
        lower = path.lower()
        if lower.endswith(_PARQUET_EXT):
            rows.extend(_read_parquet(path))
        elif lower.endswith(_JSON_EXT):
            rows.extend(_read_json(path))
        else:
            raise ValueError(
                f"unsupported data file extension: {path}. "
                f"Supported: {', '.join(_PARQUET_EXT + _JSON_EXT)} (JSON Lines = one object per line)."
            )
    return rows


# ------------------------------------------------------------------------ helpers
def to_messages(prompt: Any, row_id: int) -> list[dict]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, np.ndarray):
        prompt = prompt.tolist()
    if isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt):
        messages = [dict(m) for m in prompt]
        for m in messages:
            if "role" not in m or "content" not in m:
                raise ValueError(
                    f"row {row_id}: every prompt message needs 'role' and 'content', got {m!r}"
                )
        return messages
    raise ValueError(
        f"row {row_id}: prompt must be a string or a non-empty list of "
        f"{{'role', 'content'}} messages, got {type(prompt).__name__}: {str(prompt)[:200]!r}"
    )


def with_system_prompt(messages: list[dict], text: str) -> list[dict]:
    """``text`` as the system message, after the row's own system message if it has one."""
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def custom_rows(data_cfg, files: str | Sequence[str], tokenizer, max_samples: int) -> list[dict]:
    """The rows of verl's `data.custom_cls`: the class `name` from the file (or `pkg://` module)
    `path`, a torch Dataset built as verl builds one, `cls(data_files=files, tokenizer=tokenizer,
    processor=None, config=data, max_samples=max_samples)` (no processor: vision-language models
    are not supported), and read item by item. An item is a row as a data file's: its prompt in
    `raw_prompt` (the chat messages verl's RLHFDataset returns) or in data.prompt_key, beside its
    data_source, reward_model and extra_info."""
    from hybrid_rl.user_code import load_object

    section = data_cfg.custom_cls
    key = "data.custom_cls"
    if not section.get("name"):
        raise ValueError(f"{key}.path={section.path} needs {key}.name, the dataset class in that file.")
    cls = load_object(section.path, section.name, key, f"class {section.name}(torch.utils.data.Dataset)")
    if not (isinstance(cls, type) and issubclass(cls, Dataset)):
        raise ValueError(f"{key}.name={section.name} in {section.path} is {cls!r}, not a torch.utils.data.Dataset "
                         "subclass; name the dataset class.")
    files = [files] if isinstance(files, (str, os.PathLike)) else [str(f) for f in files]
    try:
        dataset = cls(data_files=files, tokenizer=tokenizer, processor=None, config=data_cfg, max_samples=max_samples)
        items = [dataset[i] for i in range(len(dataset))]
    except Exception as exc:  # re-raised with the call that failed
        raise ValueError(f"{key}: {section.name}(data_files={files}, tokenizer=..., processor=None, config=data, "
                         f"max_samples={max_samples}), then reading its items by index, failed with "
                         f"{type(exc).__name__}: {exc}. A dataset class is built with those keyword arguments, as "
                         "verl builds it, and needs __len__ and __getitem__.") from exc
    rows = []
    for index, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise ValueError(f"{key}: item {index} of {section.name} is a {type(item).__name__}; an item is a row, "
                             "a dict with the prompt (raw_prompt or data.prompt_key), data_source and reward_model.")
        row = dict(item)
        if "raw_prompt" in row:  # what verl generates from
            row[data_cfg.prompt_key] = row["raw_prompt"]
        rows.append(row)
    return rows


def _truncate(ids: list[int], max_len: int, mode: str) -> list[int]:
    if len(ids) <= max_len:
        return ids
    if mode == "left":
        return ids[len(ids) - max_len :]
    if mode == "right":
        return ids[:max_len]
    if mode == "middle":
        head = max_len // 2
        tail = max_len - head
        return ids[:head] + (ids[len(ids) - tail :] if tail else [])
    raise ValueError(f"unknown truncation mode {mode!r}")


# ------------------------------------------------------------------------ dataset
class RLDataset(Dataset):
    """Tokenised prompts plus the reward metadata of each row.

    ``__getitem__`` returns a dict with ``prompt_ids`` (list[int]),
    ``raw_prompt`` (chat messages), ``data_source``, ``reward_model``,
    ``extra_info``, ``index`` and ``agent_name`` (verl's column; None where absent).
    """

    def __init__(
        self,
        files: str | os.PathLike | Sequence[str | os.PathLike],
        tokenizer,
        *,
        prompt_key: str = "prompt",
        max_prompt_length: int = 512,
        truncation: str = "error",
        filter_overlong_prompts: bool = False,
        max_samples: int = -1,
        seed: int | None = None,
        apply_chat_template_kwargs: Mapping[str, Any] | None = None,
        system_prompt: str | None = None,
        rows: Sequence[Mapping] | None = None,
    ):
        """`rows`: the rows themselves (a user's dataset class's: `custom_rows`) instead of those
        read from `files`."""
        if truncation not in TRUNCATION_MODES:
            raise ValueError(
                f"data.truncation must be one of {TRUNCATION_MODES}, got {truncation!r}"
            )
        if max_prompt_length is None or int(max_prompt_length) < 1:
            raise ValueError(f"data.max_prompt_length must be >= 1, got {max_prompt_length}")
        if getattr(tokenizer, "chat_template", None) in (None, ""):
            name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
            raise ValueError(
                f"tokenizer {name!r} has no chat template, so chat prompts cannot be rendered. "
                "Use an instruct/chat model, or set actor_rollout_ref.model.custom_chat_template "
                "to a Jinja chat template."
            )
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self.max_prompt_length = int(max_prompt_length)
        self.truncation = truncation
        self.filter_overlong_prompts = bool(filter_overlong_prompts)
        self.apply_chat_template_kwargs = dict(apply_chat_template_kwargs or {})

        files_list = [files] if isinstance(files, (str, os.PathLike)) else list(files)
        self.files = [os.path.expanduser(str(f)) for f in files_list]
        rows = read_rows(self.files) if rows is None else list(rows)
        if not rows:
            raise ValueError(
                f"dataset is empty: no rows in {self.files}. Point data.train_files / data.val_files "
                "at non-empty parquet or JSON Lines files."
            )
        missing = [i for i, r in enumerate(rows) if prompt_key not in r]
        if missing:
            columns = sorted({k for r in rows for k in r})
            raise ValueError(
                f"prompt key {prompt_key!r} not found in {len(missing)} row(s) of {self.files} "
                f"(first: row {missing[0]}). Columns present: {columns}. "
                "Set data.prompt_key to the column holding the prompt."
            )

        positions = list(range(len(rows)))
        if max_samples is not None and 0 < max_samples < len(rows):
            if seed is not None:
                rng = np.random.default_rng(seed)
                positions = sorted(rng.choice(len(rows), size=int(max_samples), replace=False).tolist())
            else:
                positions = positions[: int(max_samples)]

        try:
            messages = [to_messages(rows[p][prompt_key], p) for p in positions]
        except ValueError as exc:
            raise ValueError(
                f"{self.files}: column {prompt_key!r}: {exc}. Fix those rows, or set data.prompt_key "
                "to the column holding the chat messages or prompt strings."
            ) from exc
        if system_prompt:
            messages = [with_system_prompt(m, system_prompt) for m in messages]
        prompt_ids = self._tokenize(messages)

        keep: list[int] = []
        for j, (p, ids) in enumerate(zip(positions, prompt_ids)):
            if len(ids) <= self.max_prompt_length:
                keep.append(j)
            elif self.filter_overlong_prompts:
                continue
            elif truncation == "error":
                raise ValueError(
                    f"row {p} of {self.files}: prompt is {len(ids)} tokens after the chat template, "
                    f"longer than data.max_prompt_length={self.max_prompt_length}. Fix: raise "
                    "data.max_prompt_length, set data.truncation=left|right|middle, or set "
                    "data.filter_overlong_prompts=True to drop such rows."
                )
            else:
                prompt_ids[j] = _truncate(ids, self.max_prompt_length, truncation)
                keep.append(j)
        self.num_filtered = len(positions) - len(keep)
        if self.filter_overlong_prompts and self.num_filtered:
            logger.warning(
                "filtered %d of %d prompts longer than max_prompt_length=%d",
                self.num_filtered, len(positions), self.max_prompt_length,
            )
        if not keep:
            raise ValueError(
                f"dataset is empty after filtering: all {len(positions)} prompts exceed "
                f"data.max_prompt_length={self.max_prompt_length}. Raise data.max_prompt_length "
                "or use data.truncation=left|right|middle instead of data.filter_overlong_prompts."
            )

        self._items: list[dict] = []
        for j in keep:
            p = positions[j]
            row = rows[p]
            extra_info = row.get("extra_info")
            extra_info = dict(extra_info) if isinstance(extra_info, Mapping) else {}
            index = extra_info.get("index")
            agent_name = row.get("agent_name")
            if agent_name is not None and not isinstance(agent_name, str):
                raise ValueError(f"row {p} of {self.files}: agent_name is {agent_name!r}; it names the row's agent "
                                 "loop (single_turn_agent or tool_agent) or is left empty.")
            self._items.append(
                {
                    "prompt_ids": prompt_ids[j],
                    "raw_prompt": messages[j],
                    "data_source": row.get("data_source"),
                    "reward_model": row.get("reward_model"),
                    "extra_info": extra_info,
                    "index": int(index) if index is not None else p,
                    "agent_name": agent_name,
                }
            )

    def _tokenize(self, messages: list[list[dict]]) -> list[list[int]]:
        from jinja2 import TemplateError

        try:
            texts = [
                self.tokenizer.apply_chat_template(
                    m, add_generation_prompt=True, tokenize=False, **self.apply_chat_template_kwargs
                )
                for m in messages
            ]
        except TemplateError as exc:
            raise ValueError(
                f"the tokenizer's chat template failed on the prompts of {self.files} "
                f"({type(exc).__name__}: {exc}). Fix actor_rollout_ref.model.custom_chat_template "
                "(or data.apply_chat_template_kwargs), or use a model whose template fits these prompts."
            ) from exc
        enc = self.tokenizer(texts, add_special_tokens=False)
        return [list(ids) for ids in enc["input_ids"]]

    def data_sources(self) -> list:
        """The data_source of every row, in order (selects the reward function)."""
        return [item["data_source"] for item in self._items]

    def extra_infos(self) -> list[dict]:
        """The extra_info of every row, in order (read-only: the dataset's own dicts)."""
        return [item["extra_info"] for item in self._items]

    def agent_names(self) -> list[str | None]:
        """Each row's agent loop (verl's ``agent_name`` column; None where the row names none)."""
        return [item["agent_name"] for item in self._items]

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> dict:
        item = self._items[i]
        # Shallow copies so callers cannot mutate the dataset's cached rows.
        return {**item, "prompt_ids": list(item["prompt_ids"]), "extra_info": dict(item["extra_info"])}


# ------------------------------------------------------------------------ collate
def left_padded(prompt_ids: list[list[int]], pad_token_id: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists of at most ``width`` tokens, left-padded: (input_ids, attention_mask)."""
    input_ids = torch.full((len(prompt_ids), width), int(pad_token_id), dtype=torch.long)
    attention_mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for i, ids in enumerate(prompt_ids):
        if ids:
            input_ids[i, width - len(ids):] = torch.as_tensor(ids, dtype=torch.long)
            attention_mask[i, width - len(ids):] = 1
    return input_ids, attention_mask


def collate_prompts(rows: list[dict], pad_token_id: int, max_prompt_length: int) -> Batch:
    """Left-pad ``prompt_ids`` to ``max_prompt_length`` and build a :class:`Batch`."""
    if not rows:
        raise ValueError("collate_prompts got an empty list of rows")
    if pad_token_id is None:
        raise ValueError("collate_prompts needs a pad_token_id (the tokenizer has no pad token?)")
    for i, row in enumerate(rows):
        if len(row["prompt_ids"]) > max_prompt_length:
            raise ValueError(
                f"row {i} (index {row.get('index')}) has {len(row['prompt_ids'])} prompt tokens > max_prompt_length="
                f"{max_prompt_length}; build the dataset with the same max_prompt_length"
            )
    input_ids, attention_mask = left_padded([row["prompt_ids"] for row in rows], pad_token_id, max_prompt_length)
    position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
    non_tensors = {
        key: [row.get(key) for row in rows]
        for key in ("prompt_ids", "raw_prompt", "data_source", "reward_model", "extra_info", "index", "agent_name")
    }
    non_tensors["prompt_ids"] = [list(r["prompt_ids"]) for r in rows]
    return Batch(
        {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids},
        non_tensors,
    )
