"""verl's agent loops (`rollout.agent.agent_loop_config_path`, the rows' `agent_name`): loops
written against verl's interface (tests/verl_style_agent_loops.py) run unchanged, their requests
batched; their prompts, loss masks, log-probs and extra fields reach the batch; bad files and bad
outputs are named; and one runs through the driver with the default model."""

from __future__ import annotations

import json

import pytest

from hybrid_rl.agent import ToolConfigError
from hybrid_rl.agent.verl_agent_loops import VerlAgentLoops, load_agent_loops
from hybrid_rl.config_keys import compose_config
from hybrid_rl.data import collate_prompts
from hybrid_rl.models import resolve_model_path
from hybrid_rl.protocol import BatchMeta, Sampling
from hybrid_rl.workers.rollout import generate_batch

MODULE = "tests.verl_style_agent_loops"
END = "<|im_end|>"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(None))


class CountingEngine:
    """Stands in for the engine where the test chooses what the model writes: each context is
    answered with the number of user and tool turns in it, then the end of the turn. Records the
    size of every engine call."""

    dp_rank, routes = 0, None

    def __init__(self, tok):
        self.tok = tok
        self.calls = []

    def generate_ids(self, prompts, settings, max_tokens, stop=None, stop_token_ids=None):
        self.calls.append((len(prompts), list(max_tokens), dict(settings)))
        replies = []
        for context in prompts:
            text = self.tok.decode(context)
            reply = str(text.count("<|im_start|>user") + text.count("<|im_start|>tool")) + END
            replies.append(self.tok.encode(reply))
        return replies, [[-0.5] * len(ids) for ids in replies]

    def generate(self, batch, settings, response_length):
        from hybrid_rl.workers.rollout import prompt_token_lists

        prompts = prompt_token_lists(batch)
        return self.generate_ids(prompts, settings, [response_length] * len(prompts))


def loop_file(tmp_path, *entries) -> str:
    path = tmp_path / "agent_loops.yaml"
    path.write_text(json.dumps(list(entries)))  # JSON is YAML
    return str(path)


def prompts_of(tok, questions, names, width=64, extra=None):
    rows = []
    for i, (question, name) in enumerate(zip(questions, names)):
        messages = [{"role": "user", "content": question}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        rows.append({"prompt_ids": list(ids), "raw_prompt": messages, "agent_name": name, "index": i,
                     "extra_info": {"index": i, **(extra or {})}, "data_source": "x",
                     "reward_model": {"ground_truth": "1"}})
    batch = collate_prompts(rows, tok.pad_token_id, width)
    batch.meta = BatchMeta(sampling=Sampling.TRAIN, step=1)
    return batch


def test_verl_loops_run_unchanged_with_their_requests_batched(tok, tmp_path):
    """Two loops of the user's beside verl's single_turn_agent, in one batch: every row keeps its
    place; a loop's prompt is the one it rendered; the nudge it inserted is outside the loss mask
    and has no log-probs; its extra fields and num_turns reach extra_info; and the second_look
    rows' requests went to the engine together, turn by turn."""
    path = loop_file(tmp_path, {"name": "second_look", "_target_": f"{MODULE}.SecondLookAgentLoop", "nudge": "Again?"})
    cfg = compose_config([f"actor_rollout_ref.rollout.agent.agent_loop_config_path={path}",
                          "actor_rollout_ref.rollout.agent.default_agent_loop=second_look",
                          "data.max_prompt_length=64", "data.max_response_length=40"])
    loops = VerlAgentLoops(cfg, tok, load_agent_loops(path))
    names = ["second_look", "single_turn_agent", None, "second_look"]
    prompts = prompts_of(tok, ["What is 1 + 1?", "Hi", "What is 2 + 2?", "Bye"], names)
    engine = CountingEngine(tok)
    out = generate_batch(engine, None, cfg, prompts, tok.pad_token_id, [tok.eos_token_id], agent_loops=loops)

    # single_turn_agent's row alone; the three second_look rows together, twice (the first time
    # with verl's default limit: the context left after the prompt).
    first_turn = next(call for call in engine.calls if call[0] == 3)
    assert first_turn[1] == [104 - len(prompts["prompt_ids"][i]) for i in (0, 2, 3)]
    assert sorted(n for n, _, _ in engine.calls) == [1, 3, 3]
    assert first_turn[2]["temperature"] == cfg.actor_rollout_ref.rollout.temperature
    nudge = tok.apply_chat_template([{"role": "user", "content": "Again?"}], add_generation_prompt=True,
                                    tokenize=True, return_dict=False)
    for i, name in enumerate(names):
        mask, responses = out["response_mask"][i], out["responses"][i]
        length = int(out["attention_mask"][i, 64:].sum())
        text = tok.decode(responses[:length])
        assert out["extra_info"][i]["index"] == i
        assert tok.decode(out["prompts"][i][out["attention_mask"][i, :64].bool()]) == tok.decode(prompts["prompt_ids"][i])
        if name == "single_turn_agent":
            assert text == f"1{END}" and "num_turns" not in out["extra_info"][i] and out["num_turns"][i] == 2
            continue
        # The answer, the nudge (rendered without the template's default system prompt), the answer.
        assert text.startswith(f"1{END}") and text.endswith(f"2{END}")
        inserted = mask[:length] == 0
        assert tok.decode(responses[:length][inserted]) in tok.decode(nudge)
        assert "Again?" in tok.decode(responses[:length][inserted]) and "system" not in text
        assert (out["rollout_log_probs"][i][:length][inserted] == 0).all()
        assert (out["rollout_log_probs"][i][:length][~inserted] == -0.5).all()
        assert out["extra_info"][i]["first_answer"] == "1" and out["extra_info"][i]["num_turns"] == out["num_turns"][i] == 4
    from hybrid_rl.metrics import multi_turn_metrics

    assert multi_turn_metrics(out) == {"num_turns/mean": 3.5, "num_turns/max": 4.0, "num_turns/min": 2.0}


def test_loops_waiting_on_a_tool_are_waited_for_and_reach_tools_through_verls_registry(tok, tmp_path):
    """A loop that calls our calculator (through verl's tool registry, in a thread) before it asks
    the model: the other loops' requests wait for its own, so all go to the engine at once."""
    tools = tmp_path / "tools.yaml"
    tools.write_text(json.dumps({"tools": [{"class_name": "calculator"}]}))
    path = loop_file(tmp_path, {"name": "tool_first", "_target_": f"{MODULE}.ToolFirstAgentLoop"},
                     {"name": "second_look", "_target_": f"{MODULE}.SecondLookAgentLoop"})
    cfg = compose_config([f"actor_rollout_ref.rollout.agent.agent_loop_config_path={path}",
                          f"data.tool_config_path={tools}", "data.max_prompt_length=64"])
    loops = VerlAgentLoops(cfg, tok, load_agent_loops(path))
    prompts = prompts_of(tok, ["Hi", "What is 6 * 7?", "Bye"], ["second_look", "tool_first", "second_look"],
                         extra={"expression": "6 * 7"})
    engine = CountingEngine(tok)
    out = generate_batch(engine, None, cfg, prompts, tok.pad_token_id, [tok.eos_token_id], agent_loops=loops)
    assert [n for n, _, _ in engine.calls] == [3, 2]
    prompt = tok.decode(out["prompts"][1][out["attention_mask"][1, :64].bool()])
    assert "<|im_start|>tool\n42<|im_end|>" in prompt  # the calculator's answer, rendered by the loop
    assert tok.decode(out["responses"][1][:2]) == f"2{END}" and out["extra_info"][1]["tool_reward"] == 0.0
    assert out["extra_info"][0]["first_answer"] == "1" and "first_answer" not in out["extra_info"][1]


class CallingEngine(CountingEngine):
    """Calls the calculator first, then answers with the number of tool turns it has read."""

    def generate_ids(self, prompts, settings, max_tokens, stop=None, stop_token_ids=None):
        self.calls.append(len(prompts))
        replies = []
        for context in prompts:
            text = self.tok.decode(context)
            reply = (str(text.count("<|im_start|>tool")) if "<|im_start|>tool" in text else
                     '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>')
            replies.append(self.tok.encode(reply + END))
        return replies, [[-0.5] * len(ids) for ids in replies]


def test_a_react_loop_parses_calls_with_verls_parser_and_runs_our_tools(tok, tmp_path):
    tools = tmp_path / "tools.yaml"
    tools.write_text(json.dumps({"tools": [{"class_name": "calculator"}]}))
    path = loop_file(tmp_path, {"name": "react", "_target_": f"{MODULE}.ReactAgentLoop"})
    cfg = compose_config([f"actor_rollout_ref.rollout.agent.agent_loop_config_path={path}",
                          f"data.tool_config_path={tools}", "data.max_prompt_length=400",
                          "data.max_response_length=64"])
    loops = VerlAgentLoops(cfg, tok, load_agent_loops(path))
    prompts = prompts_of(tok, ["What is 6 * 7?", "And 2 * 3?"], ["react", "react"], width=400)
    engine = CallingEngine(tok)
    out = generate_batch(engine, None, cfg, prompts, tok.pad_token_id, [tok.eos_token_id], agent_loops=loops)
    assert engine.calls == [2, 2]
    length = int(out["attention_mask"][0, 400:].sum())
    responses, mask = out["responses"][0][:length], out["response_mask"][0][:length].bool()
    assert tok.decode(responses) == ('<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}'
                                     f"</tool_call>{END}<|im_start|>tool\n42{END}\n<|im_start|>assistant\n1{END}")
    assert tok.decode(responses[~mask]) == f"<|im_start|>tool\n42{END}\n<|im_start|>assistant\n"
    assert out["extra_info"][0]["calls_made"] == 1 and out["num_turns"].tolist() == [4, 4]


def test_a_loops_own_score_replaces_the_reward_functions_for_its_rows(tok, tmp_path):
    from hybrid_rl.rewards.manager import RewardManager

    path = loop_file(tmp_path, {"name": "scoring", "_target_": f"{MODULE}.SelfScoringAgentLoop"},
                     {"name": "second_look", "_target_": f"{MODULE}.SecondLookAgentLoop"})
    cfg = compose_config([f"actor_rollout_ref.rollout.agent.agent_loop_config_path={path}"])
    loops = VerlAgentLoops(cfg, tok, load_agent_loops(path))
    prompts = prompts_of(tok, ["Hi", "Hi", "Hi"], ["scoring", "second_look", "single_turn_agent"])
    out = generate_batch(CountingEngine(tok), None, cfg, prompts, tok.pad_token_id, [tok.eos_token_id],
                         agent_loops=loops)
    reward, extra = RewardManager(tok, lambda data_source, solution_str, ground_truth, extra_info: 0.25)(out)
    # The scoring loop's row: its 1.0 on its last token; the others: the function's 0.25.
    assert extra["score"] == [1.0, 0.25, 0.25]
    lengths = out.response_lengths()
    assert reward[0, lengths[0] - 1] == 1.0 and reward[0].sum() == 1.0 and reward[2, lengths[2] - 1] == 0.25


@pytest.mark.parametrize("target, message", [
    ("NoLogProbsAgentLoop", "no response_logprobs for each response token"),
    ("BeamAgentLoop", r"sampling_params \['use_beam_search'\] are not taken here"),
])
def test_a_loops_bad_output_or_request_is_named(tok, tmp_path, target, message):
    path = loop_file(tmp_path, {"name": "bad", "_target_": f"{MODULE}.{target}"})
    cfg = compose_config([f"actor_rollout_ref.rollout.agent.agent_loop_config_path={path}"])
    loops = VerlAgentLoops(cfg, tok, load_agent_loops(path))
    with pytest.raises((ValueError, RuntimeError), match=message):
        generate_batch(CountingEngine(tok), None, cfg, prompts_of(tok, ["Hi"], ["bad"]), tok.pad_token_id,
                       [tok.eos_token_id], agent_loops=loops)


@pytest.mark.parametrize("entries, message", [
    ([{"name": "a"}], "give it a name .* and a _target_"),
    ({"name": "a"}, "must be a YAML list"),
    ([{"name": "a", "_target_": f"{MODULE}.Missing"}], "cannot import 'tests.verl_style_agent_loops.Missing'"),
    ([{"name": "a", "_target_": "json.JSONDecoder"}], "not a subclass of verl's AgentLoopBase"),
    ([{"name": "a", "_target_": "verl.experimental.agent_loop.tool_agent_loop.ToolAgentLoop"}],
     "one of verl's own agent loops"),
])
def test_bad_agent_loop_files_are_named(tmp_path, entries, message):
    path = tmp_path / "loops.yaml"
    path.write_text(json.dumps(entries))
    with pytest.raises(ToolConfigError, match=message):
        load_agent_loops(str(path))


def test_rows_naming_unknown_loops_stop_the_driver(tmp_path):
    from hybrid_rl.data.arithmetic import make_arithmetic_rows, write_rows
    from hybrid_rl.main import SetupError, checked_trainer

    rows = make_arithmetic_rows(4, seed=0)
    for row in rows:
        row["agent_name"] = "second_looks"
    data = write_rows(str(tmp_path / "a.parquet"), rows)
    path = loop_file(tmp_path, {"name": "second_look", "_target_": f"{MODULE}.SecondLookAgentLoop"})
    with pytest.raises(SetupError, match="agent_name='second_looks' is not an agent loop here; the agent loops are "
                                         "single_turn_agent, tool_agent, second_look"):
        checked_trainer(compose_config([f"data.train_files={data}", f"data.val_files={data}",
                                        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={path}"]))


@pytest.mark.slow
def test_a_verl_loop_trains_through_the_driver(ray_session, tmp_path):
    """The default model through the second_look loop: one step trains, and the engine's log-probs
    of the model's own tokens equal the trainer's, so the nudge sits where the engine saw it."""
    from tests.test_multi_turn import train_through_driver

    from hybrid_rl.data.arithmetic import make_arithmetic_rows, write_rows

    data = write_rows(str(tmp_path / "a.parquet"), make_arithmetic_rows(8, seed=5))
    path = loop_file(tmp_path, {"name": "second_look", "_target_": f"{MODULE}.SecondLookAgentLoop"})
    lines = train_through_driver([
        f"data.train_files={data}", f"data.val_files={data}", "data.max_response_length=48",
        "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "trainer.total_training_steps=1", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "actor_rollout_ref.actor.use_kl_loss=false", f"trainer.default_local_dir={tmp_path / 'run'}",
        "trainer.logger=[jsonl]", "trainer.progress_bar=false", "trainer.final_model_dir=null",
        "actor_rollout_ref.actor.fsdp_config.dtype=fp32", "actor_rollout_ref.rollout.dtype=float32",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={path}",
        "actor_rollout_ref.rollout.agent.default_agent_loop=second_look"], tmp_path / "run")
    step = lines[-1]
    assert step["step"] == 1 and "actor/pg_loss" in step
    assert step["rollout_corr/abs_logp_diff_max"] < 1e-3
