"""Interaction agents (hybrid_rl/agent/interactions.py): verl's interaction config, the rows that
choose them, and the turn loop in which the agent replies as the user, scores each answer, and
ends the conversation; failures end only their own trajectory and are counted."""

from __future__ import annotations

import asyncio
import time

import pytest

from hybrid_rl import agent
from hybrid_rl.agent.interactions import AnswerCheck, Interaction, check_interaction_rows, load_interactions
from hybrid_rl.agent.tools import ToolConfigError
from tests.test_multi_turn import (ScriptedModel, call, make_loop, multi_turn_cfg, smol_tokenizer,  # noqa: F401
                                   train_through_driver)

END = "<|im_end|>"
# verl's examples/sglang_multiturn/config/interaction_config/gsm8k_interaction_config.yaml (b178a3cd5)
VERL_GSM8K_CONFIG = """interaction:
  - name: "gsm8k"
    class_name: "verl.interactions.gsm8k_interaction.Gsm8kInteraction"
    config: {}
"""


class AsyncHint(Interaction):
    """Written as for verl's agent loop: async methods, keeps per-conversation state."""

    def __init__(self, config=None):
        super().__init__(config)
        self.open = {}

    async def start_interaction(self, instance_id, hint="", **kwargs):
        self.open[instance_id] = hint
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        await asyncio.sleep(0)
        return False, self.open[instance_id], None, {}

    async def finalize_interaction(self, instance_id, **kwargs):
        del self.open[instance_id]


class Broken(Interaction):
    def generate_response(self, instance_id, messages, **kwargs):
        raise RuntimeError("judge unreachable")


class BrokenStart(Interaction):
    def start_interaction(self, instance_id, **kwargs):
        raise ConnectionError("no judge")


class Stuck(Interaction):
    def generate_response(self, instance_id, messages, **kwargs):
        time.sleep(5)
        return True, "late", 1.0, {}


def write(tmp_path, text, name="interactions.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def row(ground_truth="635", **interaction_kwargs):
    return {"raw_prompt": [{"role": "user", "content": "What is 347 + 288?"}], "data_source": "arithmetic",
            "ground_truth": ground_truth, "extra_info": {"interaction_kwargs": interaction_kwargs}}


def test_verls_gsm8k_interaction_config_loads_as_the_answer_checker(tmp_path):
    interactions = load_interactions(write(tmp_path, VERL_GSM8K_CONFIG))
    assert list(interactions) == ["gsm8k"] and isinstance(interactions["gsm8k"], AnswerCheck)
    # Without a name, verl's rule names the entry after its class.
    unnamed = load_interactions(write(tmp_path, "interaction:\n  - class_name: tests.test_interactions.AsyncHint\n"))
    assert list(unnamed) == ["asynchint"]


@pytest.mark.parametrize("text, fragment", [
    ("interaction: []\n", "non-empty 'interaction:' list"),
    ("interaction:\n  - class_name: judge\n", "unknown interaction 'judge'"),
    ("interaction:\n  - class_name: verl.interactions.weather_interaction.WeatherInteraction\n",
     "one of verl's own interaction classes"),
    ("interaction:\n  - class_name: tests.test_interactions.write\n", "not a subclass"),
    ("interaction:\n  - {name: a, class_name: answer_check}\n  - {name: a, class_name: answer_check}\n",
     "a second interaction named 'a'"),
    ("interaction: [\n", "not valid YAML"),
])
def test_bad_interaction_configs_name_the_entry_and_the_fix(tmp_path, text, fragment):
    with pytest.raises(ToolConfigError, match=fragment):
        load_interactions(write(tmp_path, text))
    with pytest.raises(ToolConfigError, match="no such file"):
        load_interactions(str(tmp_path / "missing.yaml"))


def test_rows_choose_their_interaction_by_name(tmp_path):
    two = {"gsm8k": AnswerCheck({}), "hint": AsyncHint({})}
    check_interaction_rows([{"interaction_kwargs": {"name": "hint"}}, {"interaction_kwargs": {"name": "gsm8k"}}],
                           two, "train.parquet")
    with pytest.raises(ToolConfigError, match=r"train.parquet, row 1: .*names the interaction 'judge'.*gsm8k, hint"):
        check_interaction_rows([{"interaction_kwargs": {"name": "hint"}}, {"interaction_kwargs": {"name": "judge"}}],
                               two, "train.parquet")
    with pytest.raises(ToolConfigError, match="names the interaction None"):
        check_interaction_rows([{}], two, "train.parquet")
    check_interaction_rows([{}, None], {"gsm8k": AnswerCheck({})}, "train.parquet")  # the only one there is


def test_the_checker_asks_again_until_the_answer_is_right(smol_tokenizer):
    tok = smol_tokenizer
    model = ScriptedModel(tok, {"A": [f"It is 625.{END}", f"Sorry, it is 635.{END}", "never"],
                                "B": [f"635{END}", "never"]})
    loop = make_loop(tok, {}, interactions={"gsm8k": AnswerCheck({})})
    a, b = loop.run(model, [tok.encode("A"), tok.encode("B")], {}, [row(name="gsm8k"), row()])
    retry = "That answer is not correct. Check your work and answer again."
    assert tok.decode(a.tokens) == (f"It is 625.{END}\n<|im_start|>user\n{retry}{END}\n<|im_start|>assistant\n"
                                    f"Sorry, it is 635.{END}")
    assert (a.assistant_turns, a.interaction_turns, a.turn_scores) == (2, 1, [0.0, 1.0])
    inserted = len(tok.encode(f"\n<|im_start|>user\n{retry}{END}\n<|im_start|>assistant\n"))
    first = len(tok.encode(f"It is 625.{END}"))
    assert a.loss_mask == [1] * first + [0] * inserted + [1] * (len(a.tokens) - first - inserted)
    assert [m["role"] for m in a.messages] == ["user", "assistant", "user", "assistant"]
    assert (b.assistant_turns, b.interaction_turns, b.turn_scores) == (1, 0, [1.0])  # right at once: ends


def test_async_interactions_limits_and_failures(smol_tokenizer):
    tok = smol_tokenizer
    hint = AsyncHint({})
    turns = {"A": [f"no idea{END}"] * 6}
    (t,) = make_loop(tok, {}, interactions={"hint": hint}, max_user_turns=2).run(
        ScriptedModel(tok, turns), [tok.encode("A")], {}, [row(hint="Add the hundreds first.")])
    assert (t.assistant_turns, t.interaction_turns, t.turn_scores) == (3, 2, [])
    assert "Add the hundreds first." in tok.decode(t.tokens) and hint.open == {}  # finalized
    # A tool call and an interaction share max_user_turns; a tool call is not shown to the interaction.
    script = {"A": [f"{call('calculator', expression='347+288')}{END}", f"635{END}", "never"]}
    (t,) = make_loop(tok, {"calculator": agent.Calculator()}, interactions={"gsm8k": AnswerCheck({})}).run(
        ScriptedModel(tok, script), [tok.encode("A")], {}, [row()])
    assert (t.tool_turns, t.interaction_turns, t.turn_scores) == (1, 0, [1.0])
    # An interaction that raises or hangs ends its own trajectory, counted; the other row goes on.
    for bad in (Broken({}), Stuck({})):
        loop = make_loop(tok, {}, interactions={"bad": bad, "gsm8k": AnswerCheck({})}, tool_timeout_s=0.5)
        started = time.monotonic()
        broken, fine = loop.run(ScriptedModel(tok, {"A": [f"625{END}", "never"], "B": [f"625{END}", f"635{END}"]}),
                                [tok.encode("A"), tok.encode("B")], {}, [row(name="bad"), row(name="gsm8k")])
        assert time.monotonic() - started < 4
        assert (broken.assistant_turns, broken.interaction_errors, broken.interaction_turns) == (1, 1, 0)
        assert (fine.assistant_turns, fine.interaction_turns, fine.turn_scores) == (2, 1, [0.0, 1.0])
    # One that cannot open its conversation leaves the row without an agent.
    (t,) = make_loop(tok, {}, interactions={"bad": BrokenStart({})}).run(
        ScriptedModel(tok, {"A": [f"625{END}", "never"]}), [tok.encode("A")], {}, [row()])
    assert (t.assistant_turns, t.interaction_errors, t.interaction_turns) == (1, 1, 0)


def test_setup_accepts_interactions_without_tools(smol_tokenizer, tmp_path):
    cfg = multi_turn_cfg(None, interaction_config_path=write(tmp_path, VERL_GSM8K_CONFIG))
    setup = agent.setup(cfg, smol_tokenizer, {})
    assert setup.tools == {} and setup.system_prompt is None and list(setup.interactions) == ["gsm8k"]
    with pytest.raises(ToolConfigError, match="tool_config_path .* or .*interaction_config_path"):
        agent.setup(multi_turn_cfg(None), smol_tokenizer, {})


RECORDING_REWARD = '''
import json


def compute_score(data_source, solution_str, ground_truth, extra_info=None, record=None):
    with open(record, "a") as f:
        f.write(json.dumps({"turn_scores": extra_info["turn_scores"], "text": solution_str}) + "\\n")
    return extra_info["turn_scores"][-1] if extra_info["turn_scores"] else 0.0
'''


@pytest.mark.slow
def test_the_default_model_answers_again_through_the_driver(ray_session, tmp_path):
    """verl's GSM8K interaction config on arithmetic rows (one interaction: rows need no name): a
    wrong answer gets the checker's reply and another turn, the interaction's scores reach the
    reward function, and the engine's log-probs of the trained tokens match the trainer's after
    the inserted user turns."""
    import json

    from hybrid_rl.data.arithmetic import make_arithmetic_rows, write_rows

    data = write_rows(str(tmp_path / "arith.parquet"), make_arithmetic_rows(8, seed=5, lo=100, hi=999))
    (tmp_path / "reward.py").write_text(RECORDING_REWARD)
    record = tmp_path / "record.jsonl"
    metrics = train_through_driver([
        f"data.train_files={data}", "data.val_files=null", "data.max_response_length=64",
        "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "trainer.total_training_steps=1", "actor_rollout_ref.actor.use_kl_loss=false",  # no reference model
        f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.logger=[jsonl]", "trainer.progress_bar=false",
        "trainer.final_model_dir=null", "actor_rollout_ref.actor.fsdp_config.dtype=fp32",
        "actor_rollout_ref.rollout.dtype=float32", "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={write(tmp_path, VERL_GSM8K_CONFIG)}",
        "actor_rollout_ref.rollout.multi_turn.max_user_turns=1",
        f"custom_reward_function.path={tmp_path / 'reward.py'}", "custom_reward_function.name=compute_score",
        f"+custom_reward_function.reward_kwargs.record={record}",
    ], tmp_path / "run")
    (step,) = metrics
    seen = [json.loads(line) for line in open(record)]
    # Each finished first answer is scored once (max_user_turns=1 leaves the second unscored), one
    # cut by the token budget not at all; a wrong one is asked again where the budget leaves room.
    retried = [r for r in seen if "That answer is not correct." in r["text"]]
    assert len(seen) == 8 and all(r["turn_scores"] in ([], [0.0], [1.0]) for r in seen)
    assert retried and all(r["turn_scores"] == [0.0] for r in retried)
    assert step["multi_turn/interaction_turns/mean"] == len(retried) / 8 > 0
    assert step["multi_turn/interaction_errors/mean"] == 0
    assert step["rollout_corr/abs_logp_diff_max"] < 1e-3
