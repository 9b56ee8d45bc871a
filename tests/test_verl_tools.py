"""Tool classes written for verl's agent loop (hybrid_rl/agent/verl_tools.py): a file with verl's
imports loads unchanged, each call runs create / execute / release with the row's tools_kwargs,
the calls' rewards and the tools' extra fields reach the reward function, verl's GSM8K tool
config scores answers, and failing or hanging tools are contained and counted."""

from __future__ import annotations

import json
import sys
import time

import pytest

from hybrid_rl import agent
from hybrid_rl.agent.loop import Trajectory
from hybrid_rl.agent.tools import ToolConfigError
from hybrid_rl.agent.verl_tools import Gsm8kAnswerTool, VerlTool
from tests.test_multi_turn import (ScriptedModel, call, make_loop, smol_tokenizer,  # noqa: F401
                                   train_through_driver, write_tool_config)

END = "<|im_end|>"

# A tool module as verl users write them (verl's imports; state per instance; async methods).
VERL_STYLE_TOOLS = '''
import asyncio
from typing import Any, Optional
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from verl.utils.rollout_trace import rollout_trace_op

EVENTS = []


class GuessTool(BaseTool):
    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._instance_dict = {}

    async def create(self, instance_id: Optional[str] = None, **kwargs):
        instance_id = instance_id or str(uuid4())
        self._instance_dict[instance_id] = kwargs["create_kwargs"]["secret"]
        EVENTS.append("create")
        return instance_id, ToolResponse()

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        await asyncio.sleep(0)
        agent_data = kwargs["agent_data"]
        guess, secret = int(parameters["guess"]), self._instance_dict[instance_id]
        agent_data.extra_fields.setdefault("guesses", []).append(guess)
        agent_data.extra_fields["asked"] = agent_data.messages[0]["content"]
        if parameters.get("explode"):
            raise RuntimeError("the tool has a bug")
        if parameters.get("hang"):
            await asyncio.sleep(60)
        EVENTS.append("execute")
        text = "right" if guess == secret else ("higher" if guess < secret else "lower")
        return ToolResponse(text=text), float(guess == secret) * self.config["bonus"], {}

    async def release(self, instance_id: str, **kwargs):
        EVENTS.append("release")
        del self._instance_dict[instance_id]


class PictureTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text="see", image=["<an image>"]), 0.0, {}
'''
GUESS_SCHEMA = {"type": "function", "function": {
    "name": "guess", "description": "Guess the secret number.",
    "parameters": {"type": "object", "properties": {"guess": {"type": "integer", "description": "a number"}},
                   "required": ["guess"]}}}
# verl's examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml (verl b178a3cd5), as data.
VERL_GSM8K_TOOL = {"class_name": "verl.tools.gsm8k_tool.Gsm8kTool", "config": {"type": "native"}, "tool_schema": {
    "type": "function", "function": {
        "name": "calc_gsm8k_reward",
        "description": "A tool for calculating the reward of gsm8k. (1.0 if parsed answer is correct, 0.0 if parsed "
                       "answer is incorrect or not correctly parsed)",
        "parameters": {"type": "object", "properties": {"answer": {
            "type": "string", "description": "The model's answer to the GSM8K math problem, must be a digits"}},
            "required": ["answer"]}}}}


@pytest.fixture()
def verl_style_module(tmp_path, monkeypatch):
    """The module above as an importable package of the user's, fresh for each test."""
    package = tmp_path / "user_verl_tools"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "guess.py").write_text(VERL_STYLE_TOOLS)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("user_verl_tools", "user_verl_tools.guess"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return "user_verl_tools.guess"


def load(tmp_path, *entries):
    return agent.load_tools(write_tool_config(tmp_path / "tools.yaml", *entries))


def row(prompt, **tools_kwargs):
    return {"raw_prompt": [{"role": "user", "content": prompt}], "data_source": "x", "ground_truth": None,
            "extra_info": {"tools_kwargs": tools_kwargs}}


def test_verl_tool_classes_load_unchanged_and_run_create_execute_release_per_call(
        tmp_path, verl_style_module, smol_tokenizer):
    verl_before = sys.modules.get("verl")
    tools = load(tmp_path, {"class_name": f"{verl_style_module}.GuessTool", "config": {"type": "native", "bonus": 2},
                            "tool_schema": GUESS_SCHEMA})
    assert sys.modules.get("verl") is verl_before  # verl's imports resolved to ours only while the file loaded
    assert isinstance(tools["guess"], VerlTool) and tools["guess"].schema == GUESS_SCHEMA
    assert tools["guess"].impl.config == {"type": "native", "bonus": 2}  # the entry's config, as verl passes it
    tok = smol_tokenizer
    model = ScriptedModel(tok, {"A": [f"{call('guess', guess=3)}{END}", f"{call('guess', guess=7)}{END}", f"7{END}"],
                                "B": [f"{call('guess', guess=5)}{END}", f"5{END}"],
                                "C": [f"no tools{END}"]})
    rows = [row("A?", guess={"create_kwargs": {"secret": 7}}), row("B?", guess={"create_kwargs": {"secret": 5}}),
            row("C?")]
    a, b, c = make_loop(tok, tools, 300).run(model, [tok.encode(p) for p in "ABC"], {}, rows)
    text = tok.decode(a.tokens)
    assert "tool\nhigher" in text and "tool\nright" in text
    assert (a.tool_calls, a.tool_errors, a.tool_rewards) == (2, 0, [0.0, 2.0])
    assert a.extra_fields == {"guesses": [3, 7], "asked": "A?"}  # agent_data: the row's own trajectory
    assert (b.tool_rewards, b.extra_fields["guesses"], c.tool_rewards, c.extra_fields) == ([2.0], [5], [], {})
    events = sys.modules[verl_style_module].EVENTS
    assert [events.count(e) for e in ("create", "execute", "release")] == [3, 3, 3]
    assert tools["guess"].impl._instance_dict == {}  # every instance released


def test_verls_gsm8k_tool_config_scores_answers_against_the_rows_ground_truth(tmp_path, smol_tokenizer):
    (tool,) = load(tmp_path, VERL_GSM8K_TOOL).values()
    assert isinstance(tool.impl, Gsm8kAnswerTool) and tool.name == "calc_gsm8k_reward"

    def submit(answer, truth="72"):
        output = tool.call({"answer": answer}, Trajectory(tools_kwargs={
            "calc_gsm8k_reward": {"create_kwargs": {"ground_truth": truth}}}), 5)
        return output.text, output.reward

    # verl's answers: the parsed answer and its score; the call's reward is verl's -0.05 unless it improved.
    assert submit("72") == ("Current parsed answer='72' reward=1.0", 0.0)
    assert submit("#### 72") == ("Current parsed answer='#### 72' reward=1.0", 0.0)
    assert submit("I think 70 or 72") == ("Current parsed answer='I think 70 or 72' reward=1.0", 0.0)
    assert submit(72) == ("Current parsed answer='72' reward=1.0", 0.0)
    assert submit("71") == ("Current parsed answer='71' reward=0.0", -0.05)
    assert submit("none") == ("Current parsed answer='none' reward=0.0", -0.05)
    # A row without the tool's create_kwargs: the call fails naming what the row lacks, counted.
    tok = smol_tokenizer
    model = ScriptedModel(tok, {"A": [f"{call('calc_gsm8k_reward', answer='72')}{END}", f"72{END}"]})
    (t,) = make_loop(tok, {tool.name: tool}, 300).run(model, [tok.encode("A")], {}, [row("A?")])
    assert t.tool_errors == 1 and "create_kwargs.ground_truth" in tok.decode(t.tokens)


def test_failing_and_hanging_verl_tools_are_answered_with_errors_and_still_released(
        tmp_path, verl_style_module, smol_tokenizer):
    tools = load(tmp_path, {"class_name": f"{verl_style_module}.GuessTool", "config": {"type": "native", "bonus": 1},
                            "tool_schema": GUESS_SCHEMA},
                 {"class_name": f"{verl_style_module}.PictureTool", "config": {"type": "native"},
                  "tool_schema": {"type": "function", "function": {"name": "look", "description": "Look."}}})
    tok = smol_tokenizer
    model = ScriptedModel(tok, {"A": [f"{call('guess', guess=1, explode=True)}{END}",
                                      f"{call('guess', guess=1, hang=True)}{END}", f"{call('look')}{END}",
                                      f"{call('guess', guess=4)}{END}", f"done{END}"]})
    start = time.monotonic()
    (t,) = make_loop(tok, tools, 500, tool_timeout_s=1).run(
        model, [tok.encode("A")], {}, [row("A?", guess={"create_kwargs": {"secret": 4}})])
    assert time.monotonic() - start < 10
    text = tok.decode(t.tokens)
    assert "guess failed: RuntimeError: the tool has a bug" in text
    assert "within 1 s" in text  # the hanging call is cancelled at tool_timeout_s
    assert "images or videos; rollouts here are text-only" in text
    assert "tool\nright" in text  # the tool works again after its failures
    assert (t.tool_calls, t.tool_errors, t.tool_rewards) == (4, 3, [0.0, 0.0, 0.0, 1.0])
    time.sleep(0.2)  # the cancelled call's release runs on the tools' event loop
    assert tools["guess"].impl._instance_dict == {}  # released after the error and the cancellation too


@pytest.mark.parametrize("entry, fragment", [
    ({"class_name": "verl.tools.search_tool.SearchTool", "config": {"type": "native"}},
     "one of verl's own tool classes, which has no equivalent here"),
    ({"class_name": "{module}.GuessTool", "config": {"type": "native"}}, "no tool_schema"),
    ({"class_name": "{module}.GuessTool", "config": {"type": "mcp"}}, "only native tools run here"),
    ({"class_name": "{module}.GuessTool", "config": {"type": "native"}, "tool_schema": {"type": "function"}},
     "tool_schema is not an OpenAI function schema"),
    ({"class_name": "{module}.Missing", "config": {"type": "native"}}, "cannot import"),
])
def test_bad_verl_tool_entries_name_the_entry_and_the_fix(tmp_path, verl_style_module, entry, fragment):
    entry = json.loads(json.dumps(entry).replace("{module}", verl_style_module))
    with pytest.raises(ToolConfigError, match=fragment):
        load(tmp_path, entry)


VERL_STYLE_INTERACTION = '''
from verl.interactions.base import BaseInteraction


class Parrot(BaseInteraction):
    async def generate_response(self, instance_id, messages, **kwargs):
        return True, "bye", 0.5, {}
'''


def test_a_verl_interaction_file_loads_unchanged(tmp_path, monkeypatch):
    (tmp_path / "user_verl_interaction.py").write_text(VERL_STYLE_INTERACTION)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tmp_path / "interactions.yaml"
    config.write_text("interaction:\n  - class_name: user_verl_interaction.Parrot\n")
    (parrot,) = agent.load_interactions(str(config)).values()
    assert parrot.name == "parrot" and isinstance(parrot, agent.Interaction)


RECORDING_REWARD = '''
import json


def compute_score(data_source, solution_str, ground_truth, extra_info=None, record=None):
    with open(record, "a") as f:
        f.write(json.dumps({"tool_rewards": extra_info["tool_rewards"], "text": solution_str,
                            "truth": ground_truth}) + "\\n")
    return 0.0
'''
SUBMIT_HINT = (' Submit the answer {answer} with the tool: write <tool_call>{{"name": "calc_gsm8k_reward", "arguments": '
               '{{"answer": "{answer}"}}}}</tool_call>, read its reply, then reply with only the final number.')


@pytest.mark.slow
def test_verls_gsm8k_tool_runs_through_the_driver_and_its_rewards_reach_the_reward_function(ray_session, tmp_path):
    """verl's GSM8K tool config on arithmetic rows whose tools_kwargs carry the ground truth, as
    verl's gsm8k_multiturn_w_tool preprocessing writes them, the default model shown the call (half
    the rows with the right answer, half a wrong one): each call's score in the tool's reply
    matches the submitted answer, and the calls' rewards reach the reward function."""
    import re

    from hybrid_rl.data.arithmetic import make_arithmetic_rows, write_rows

    rows = make_arithmetic_rows(16, seed=7, lo=100, hi=999)
    for i, r in enumerate(rows):  # half the rows are told to submit the right answer, half a wrong one
        info, truth = r["extra_info"], int(r["reward_model"]["ground_truth"])
        r["prompt"][0]["content"] = (f"Calculate {info['a']} {info['op']} {info['b']}."
                                     + SUBMIT_HINT.format(answer=truth + i % 2))
        info["tools_kwargs"] = {"calc_gsm8k_reward": {"create_kwargs": {
            "ground_truth": str(r["reward_model"]["ground_truth"])}}}
    data = write_rows(str(tmp_path / "arith.parquet"), rows)
    (tmp_path / "reward.py").write_text(RECORDING_REWARD)
    record = tmp_path / "record.jsonl"
    metrics = train_through_driver([
        f"data.train_files={data}", f"data.val_files={data}", "data.max_prompt_length=384",
        "data.max_response_length=96", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.total_training_steps=1",
        "actor_rollout_ref.actor.use_kl_loss=false", f"trainer.default_local_dir={tmp_path / 'run'}",
        "trainer.logger=[jsonl]", "trainer.progress_bar=false", "trainer.final_model_dir=null",
        "actor_rollout_ref.actor.fsdp_config.dtype=fp32", "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.multi_turn.enable=true", "actor_rollout_ref.rollout.multi_turn.describe_tools=system",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={write_tool_config(tmp_path / 't.yaml', VERL_GSM8K_TOOL)}",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
        f"custom_reward_function.path={tmp_path / 'reward.py'}", "custom_reward_function.name=compute_score",
        f"+custom_reward_function.reward_kwargs.record={record}",
    ], tmp_path / "run")
    val, step = metrics[:2]
    seen = [json.loads(line) for line in open(record)]  # greedy validation answers and the step's samples
    # The tool's long description confuses the 135M model: about a third of greedy answers call it
    # (5 of 16 when written), the rest describe the tool; the calls are what is checked.
    assert len(seen) >= 32 and val["val/multi_turn/tool_call_share"] >= 2 / 16
    scores = []
    for sample in seen:
        answered = re.findall(r"Current parsed answer='(.*?)' reward=([0-9.]+)", sample["text"])
        assert len(answered) <= len(sample["tool_rewards"])  # a reply that did not fit the budget is not in the text
        for (answer, score), reward in zip(answered, sample["tool_rewards"]):
            right = [n.replace(",", "") for n in re.findall(r"-?[0-9][0-9,]*", answer)][-1:] == [str(sample["truth"])]
            assert (float(score), reward) == ((1.0, 0.0) if right else (0.0, -0.05)), sample
            scores.append(float(score))
    assert 1.0 in scores and 0.0 in scores  # right and wrong submissions both scored against the row's truth
    assert step["multi_turn/tool_errors/mean"] == 0 == val["val/multi_turn/tool_errors/mean"]
    assert step["rollout_corr/abs_logp_diff_max"] < 1e-3
