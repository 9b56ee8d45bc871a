"""What a reward model reads: rows of token ids built from rollouts or from labelled text.

When the reward model's tokenizer and chat template are the policy's, it reads the rollout's own
token rows; otherwise each row is decoded and re-templated for it (the row's chat plus the
response as the assistant's turn, through the reward model's chat template). A row longer than
`reward_model.max_length` keeps its last tokens (the response end, where the score is read).
A process reward model reads a score at the end of each reasoning step (`RewardInputs.with_steps`);
a step-tag scorer reads the response with a tag after each step, always re-templated.
"""

from __future__ import annotations

import torch

from hybrid_rl.engines.base import FORWARD_KEYS
from hybrid_rl.protocol import Batch
from hybrid_rl.rewards.steps import decoded_prefix_lengths, step_ends, tag_steps, token_at


def pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)


def same_tokenizer(a, b) -> bool:
    """Whether two tokenizers turn a chat into the same ids (vocabulary and chat template)."""
    return a.get_vocab() == b.get_vocab() and a.chat_template == b.chat_template


class RewardInputs:
    """The reward model's rows ([left-padded prompt | right-padded response], as the engines
    take them) for a batch of rollouts."""

    def __init__(self, policy_tokenizer, reward_tokenizer, max_length: int | None, step_tag: str | None = None):
        self.policy, self.reward, self.step_tag = policy_tokenizer, reward_tokenizer, step_tag
        self.retemplate = not same_tokenizer(policy_tokenizer, reward_tokenizer)
        if self.retemplate and not reward_tokenizer.chat_template and step_tag is None:
            raise ValueError("The reward model's tokenizer differs from the policy's, so each response is re-templated "
                             "for it, but it has no chat template. Add one (chat_template in its tokenizer_config.json) "
                             "or use a reward model that shares the policy's tokenizer.")
        if (self.retemplate or step_tag) and not reward_tokenizer.is_fast:
            raise ValueError("The reward model's tokenizer is a slow (Python) tokenizer, and the reward model reads "
                             "re-templated text (its tokenizer differs from the policy's, or it is a step-tag scorer), "
                             "which needs a fast one (a tokenizer.json in the reward model's folder).")
        self.max_length = max_length
        self.pad_token_id = pad_id(reward_tokenizer)

    def __call__(self, batch: Batch) -> tuple[Batch, torch.Tensor]:
        """The rows, and which of them were cut to `max_length` (B,) bool."""
        rows, cut, _ = self.with_steps(batch, None)
        return rows, cut

    def with_steps(self, batch: Batch, separator: str | None) -> tuple[Batch, torch.Tensor, list | None]:
        """The rows, which were cut, and with a step `separator` (`hybrid_rl.rewards.steps`) each
        row's steps as (policy token, reward-model token) pairs, both response positions of the
        step's end (for a step-tag scorer, the reward model's token ending the tag written after
        the step); a step whose end was cut away is dropped."""
        tagged = self.step_tag is not None and separator is not None
        retemplate = self.retemplate or tagged
        fast = not retemplate and (self.max_length is None or batch["input_ids"].shape[1] <= self.max_length)
        if fast and separator is None:
            return batch.select(list(FORWARD_KEYS), non_tensor_keys=[]), torch.zeros(len(batch), dtype=torch.bool), None
        resp_width = batch["responses"].shape[1]
        prompt_width = batch["input_ids"].shape[1] - resp_width
        rows, cut, steps = [], torch.zeros(len(batch), dtype=torch.bool), []
        for i in range(len(batch)):
            mask = batch["attention_mask"][i].bool()
            prompt_ids = batch["input_ids"][i, :prompt_width][mask[:prompt_width]].tolist()
            response_ids = batch["responses"][i][mask[prompt_width:]].tolist()
            answer = self.policy.decode(response_ids, skip_special_tokens=True) if retemplate or separator else ""
            ends = step_ends(answer, separator) if separator is not None else []
            policy_ends = decoded_prefix_lengths(self.policy, response_ids) if ends else []
            policy_tokens = [token_at(policy_ends, end) for end in ends]
            read_at = policy_tokens
            if retemplate:
                text, read_ends = tag_steps(answer, ends, separator, self.step_tag) if tagged else (answer, ends)
                prompt_ids, response_ids, answer_ends = template_encoding(self.reward, batch["raw_prompt"][i], text,
                                                                          plain_without_template=tagged)
                if ends and answer_ends is None:
                    raise ValueError("The reward model's chat template changes the response text, so its steps cannot "
                                     "be found in what the process reward model reads; use one that shares the "
                                     "policy's tokenizer, or whose template keeps the assistant's text verbatim.")
                read_at = [token_at(answer_ends, end) for end in read_ends]
            excess = len(prompt_ids) + len(response_ids) - (self.max_length or 10**12)
            if excess > 0:
                cut[i] = True
                shift = max(0, excess - len(prompt_ids))
                prompt_ids, response_ids = prompt_ids[excess:], response_ids[shift:]
                read_at = [token - shift for token in read_at]
            rows.append((prompt_ids, response_ids))
            steps.append([(p, r) for p, r in zip(policy_tokens, read_at) if r >= 0])
        out = batch.select(list(FORWARD_KEYS), non_tensor_keys=[]) if fast else collate_rows(rows, self.pad_token_id)
        return out, cut, steps if separator is not None else None


def template_ids(tokenizer, chat, answer: str) -> tuple[list[int], list[int]]:
    """`tokenizer`'s ids of the chat up to the assistant's turn, and of that turn (`answer`
    through its chat template)."""
    prompt_ids, answer_ids, _ = template_encoding(tokenizer, chat, answer)
    return prompt_ids, answer_ids


def template_encoding(tokenizer, chat, answer: str,
                      plain_without_template: bool = False) -> tuple[list[int], list[int], list[int] | None]:
    """`template_ids`, plus where each token of the assistant's turn ends as a character offset
    into `answer` (None when the template does not hold `answer` verbatim). With
    `plain_without_template`, a tokenizer without a chat template reads the last user message, a
    space and `answer` (Math-Shepherd's format for its step-tag scorers)."""
    messages = [dict(m) for m in chat]
    if tokenizer.chat_template or not plain_without_template:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        full = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": answer}], tokenize=False)
    else:
        prompt = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "") + " "
        full = prompt + answer
    if not full.startswith(prompt):  # a template that rewrites earlier turns: score it as one piece
        prompt = ""
    # The whole text is tokenized at once and split where the answer starts.
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    split = sum(1 for start, _ in encoded["offset_mapping"] if start < len(prompt))
    answer_start = full.find(answer, len(prompt))
    answer_ends = None if answer_start < 0 else [end - answer_start for _, end in encoded["offset_mapping"][split:]]
    return encoded["input_ids"][:split], encoded["input_ids"][split:], answer_ends


def collate_rows(rows: list[tuple[list[int], list[int]]], pad_token_id: int) -> Batch:
    """(prompt ids, response ids) pairs as [left-padded prompt | right-padded response] rows."""
    prompt_width = max(len(p) for p, _ in rows)
    resp_width = max(1, max(len(r) for _, r in rows))
    ids = torch.full((len(rows), prompt_width + resp_width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (prompt, response) in enumerate(rows):
        start = prompt_width - len(prompt)
        ids[i, start:prompt_width + len(response)] = torch.tensor(prompt + response, dtype=torch.long)
        mask[i, start:prompt_width + len(response)] = 1
    return Batch(tensors={"input_ids": ids, "attention_mask": mask,
                          "position_ids": (mask.cumsum(-1) - 1).clamp_min(0), "responses": ids[:, prompt_width:]})
