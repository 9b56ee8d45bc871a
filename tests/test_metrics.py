"""Per-step data metrics against values counted by hand."""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.metrics import compute_data_metrics
from hybrid_rl.protocol import Batch


def _batch(lengths, scores, response_width=6):
    rows = len(lengths)
    response_mask = torch.tensor([[1] * n + [0] * (response_width - n) for n in lengths])
    token_scores = torch.zeros(rows, response_width)
    for row, (n, score) in enumerate(zip(lengths, scores)):
        token_scores[row, n - 1] = score  # the score sits on the last response token
    return Batch({"prompts": torch.ones(rows, 2, dtype=torch.long),
                  "attention_mask": torch.cat([torch.ones(rows, 2, dtype=torch.long), response_mask], 1),
                  "response_mask": response_mask, "token_level_scores": token_scores,
                  "token_level_rewards": token_scores, "advantages": token_scores})


def test_lengths_of_right_and_wrong_answers_are_reported_apart():
    metrics = compute_data_metrics(_batch([2, 4, 6, 3, 5], [1.0, 0.0, 0.0, 1.0, -1.0]))
    assert metrics["response_length/mean"] == pytest.approx(4.0)
    assert metrics["response_length/correct_mean"] == pytest.approx((2 + 3) / 2)
    assert metrics["response_length/incorrect_mean"] == pytest.approx((4 + 6 + 5) / 3)
    assert metrics["response_length/clip_ratio"] == pytest.approx(1 / 5)


def test_a_batch_with_no_right_answer_has_no_correct_length():
    metrics = compute_data_metrics(_batch([2, 4], [0.0, 0.0]))
    assert "response_length/correct_mean" not in metrics
    assert metrics["response_length/incorrect_mean"] == pytest.approx(3.0)
