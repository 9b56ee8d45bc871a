"""Multi-turn tool rollouts (hybrid_rl/agent): tool-call parsing, the tools, the chat template's tool
turns, the turn loop's limits and failure handling, the loss mask, and a run through the driver in
which the default model calls the calculator."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch
from omegaconf import OmegaConf

from hybrid_rl import agent
from hybrid_rl.agent.loop import ChatTurns, MultiTurnError, truncate_text
from hybrid_rl.agent.tools import Tool, ToolConfigError, ToolOutput
from hybrid_rl.models import resolve_model_path
from hybrid_rl.protocol import Batch
from hybrid_rl.workers.rollout import assemble_rollout


@pytest.fixture(scope="module")
def smol_tokenizer():
    """The default model's tokenizer: its ChatML template renders a 'tool' role but ignores `tools`."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(None))


def write_tool_config(path, *entries) -> str:
    path.write_text(json.dumps({"tools": list(entries)}))  # JSON is YAML
    return str(path)


def multi_turn_cfg(tool_config_path, **overrides):
    base = {"enable": True, "tool_config_path": tool_config_path, "interaction_config_path": None,
            "max_assistant_turns": None, "max_user_turns": None,
            "max_parallel_calls": 1, "max_tool_response_length": 256, "tool_response_truncate_side": "middle",
            "format": "hermes", "describe_tools": "system", "tool_timeout_s": 10}
    return OmegaConf.create({"multi_turn": {**base, **overrides}})


def train_through_driver(overrides: list[str], run_dir) -> list[dict]:
    """Compose ``overrides`` as the command line would, train through the driver, and return the
    metrics lines of ``run_dir`` (the run's trainer.default_local_dir)."""
    from hybrid_rl.config_keys import compose_config
    from hybrid_rl.main import build_trainer

    trainer = build_trainer(compose_config(overrides))
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def call(name, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


# ------------------------------------------------------------------------------------------ parsing
def test_hermes_calls_are_parsed_and_malformed_ones_named():
    calls, errors = agent.Hermes(None).parse('I will check. <tool_call>\n{"name": "calculator", "arguments": '
                                           '{"expression": "2+3"}}\n</tool_call> and <tool_call>{"name": "python", '
                                           '"arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>')
    assert [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": "2+3"}),
                                                      ("python", {"code": "print(1)"})]
    assert errors == []
    assert agent.Hermes(None).parse("the answer is 5") == ([], [])
    for text, fragment in [('<tool_call>{"name": "calculator", "arguments": {"expression": }</tool_call>', "not valid JSON"),
                           ('<tool_call>{"arguments": {}}</tool_call>', '"name"'),
                           ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "JSON object"),
                           ('<tool_call>{"name": "calculator"', "not closed")]:
        calls, errors = agent.Hermes(None).parse(text)
        assert calls == [] and len(errors) == 1 and fragment in errors[0], (text, errors)


def test_tool_output_truncation_keeps_the_chosen_side():
    text = "abcdefghij"
    assert truncate_text(text, 20, "middle") == text
    assert truncate_text(text, 4, "left") == "abcd...(truncated)"
    assert truncate_text(text, 4, "right") == "(truncated)...ghij"
    assert truncate_text(text, 4, "middle") == "ab...(truncated)...ij"


# ------------------------------------------------------------------------------------------- tools
def test_calculator_evaluates_arithmetic_and_refuses_everything_else():
    calc = agent.Calculator()
    assert calc.execute({"expression": "(12 + 7) * 3"}) == ToolOutput("57")
    assert calc.execute({"expression": "7 / 2"}) == ToolOutput("3.5")
    assert calc.execute({"expression": "-2 ** 3 + 10 // 3 - 9 % 4"}) == ToolOutput(str(-2 ** 3 + 10 // 3 - 9 % 4))
    for bad in ["__import__('os').system('true')", "x + 1", "1 / 0", "9 ** 9 ** 9", "(1, 2)", "2 +"]:
        out = calc.execute({"expression": bad})
        assert out.error and out.text.startswith("Error"), (bad, out)
    assert calc.execute({}).error


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="the code sandbox needs bubblewrap")
def test_python_tool_runs_in_the_sandbox_with_a_timeout():
    tool = agent.PythonTool(timeout_s=2)
    try:
        assert tool.execute({"code": "print(sum(range(10)))"}) == ToolOutput("45")
        crash = tool.execute({"code": "raise ValueError('boom')"})
        assert crash.error and "ValueError: boom" in crash.text
        start = time.monotonic()
        hang = tool.execute({"code": "while True: pass"})
        assert hang.error and "longer than 2 s" in hang.text and time.monotonic() - start < 10
        net = tool.execute({"code": "import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)"})
        assert net.error
    finally:
        tool.close()


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="the code sandbox needs bubblewrap")
def test_verls_sandbox_fusion_tool_config_runs_in_the_local_sandbox(tmp_path):
    """An entry shaped like verl's examples/sglang_multiturn/config/tool_config/sandbox_fusion_tool_config.yaml."""
    path = tmp_path / "sandbox_fusion_tool_config.yaml"
    path.write_text("""tools:
  - class_name: "verl.tools.sandbox_fusion_tools.SandboxFusionTool"
    config:
      sandbox_fusion_url: "https://example.invalid/run_code"
      num_workers: 10
      enable_global_rate_limit: true
      rate_limit: 10
      default_timeout: 3
      default_language: "python"
      memory_limit_mb: 512
      type: native
    tool_schema:
      type: "function"
      function:
        name: "code_interpreter"
        description: "A tool for executing code."
        parameters: {type: "object", properties: {code: {type: "string"}}, required: ["code"]}
""")
    tools = agent.load_tools(str(path))
    tool = tools["code_interpreter"]
    try:
        assert (tool.sandbox.timeout_s, tool.sandbox.memory_mb) == (3, 512)
        assert tool.execute({"code": "print(6 * 7)"}) == ToolOutput("42")
    finally:
        tool.close()
    path.write_text(path.read_text().replace('"python"', '"cpp"'))
    with pytest.raises(ToolConfigError, match="runs Python only"):
        agent.load_tools(str(path))


class Echo(Tool):
    default_schema = {"type": "function", "function": {"name": "echo", "parameters": {"type": "object"}}}

    def __init__(self, schema=None, prefix=""):
        super().__init__(schema)
        self.prefix = prefix

    def execute(self, arguments):
        return ToolOutput(self.prefix + str(arguments.get("text", "")))


class Sleeper(Tool):
    default_schema = {"type": "function", "function": {"name": "sleeper", "parameters": {"type": "object"}}}

    def execute(self, arguments):
        time.sleep(30)
        return ToolOutput("woke up")


class Crasher(Tool):
    default_schema = {"type": "function", "function": {"name": "crasher", "parameters": {"type": "object"}}}

    def execute(self, arguments):
        raise RuntimeError("the tool has a bug")


def test_tool_config_loads_ours_and_dotted_classes_and_names_bad_entries(tmp_path):
    tools = agent.load_tools(write_tool_config(
        tmp_path / "tools.yaml", {"class_name": "calculator", "config": {"type": "native"}},
        {"class_name": "tests.test_multi_turn.Echo", "config": {"prefix": "> "}}))
    assert sorted(tools) == ["calculator", "echo"] and tools["echo"].execute({"text": "hi"}).text == "> hi"
    cases = [
        ({"class_name": "search"}, "unknown tool 'search'"),
        ({"class_name": "verl.tools.search_tool.SearchTool"}, "one of verl's own tool classes"),
        ({"class_name": "tests.test_multi_turn.Nope"}, "cannot import"),
        ({"class_name": "tests.test_multi_turn.call"}, "not a subclass"),
        ({"class_name": "calculator", "config": {"digits": 3}}, "does not take the config"),
        ({"config": {}}, "needs a class_name"),
    ]
    for entry, message in cases:
        with pytest.raises(ToolConfigError, match=message):
            agent.load_tools(write_tool_config(tmp_path / "bad.yaml", entry))
    with pytest.raises(ToolConfigError, match="a second tool named 'calculator'"):
        agent.load_tools(write_tool_config(tmp_path / "twice.yaml", {"class_name": "calculator"},
                                           {"class_name": "calculator"}))
    with pytest.raises(ToolConfigError, match="no such file"):
        agent.load_tools(str(tmp_path / "missing.yaml"))


# A function-tool file as verl users write them: verl's import, docstrings that give the schema.
FUNCTION_TOOLS = '''
from verl.tools.function_tool import function_tool


@function_tool
def add(a: int, b: int) -> str:
    """Add two whole numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return str(a + b)


@function_tool("lookup")
async def find_capital(country: str):
    """The capital of a country.

    Args:
        country: The country's English name.
    """
    return {"country": country, "capital": {"France": "Paris"}.get(country, "unknown")}, 1.0, {"hits": 1}


@function_tool(schema={"type": "function", "function": {"name": "fail", "description": "Always fails.",
                                                       "parameters": {"type": "object", "properties": {}}}})
def fail():
    raise RuntimeError("the service is down")


def helper():  # not decorated: not a tool
    return 0
'''


def test_function_tools_load_from_a_verl_file_with_their_inferred_schemas(tmp_path, smol_tokenizer):
    import sys

    path = tmp_path / "tools.py"
    path.write_text(FUNCTION_TOOLS)
    verl_before = sys.modules.get("verl")
    tools = agent.load_function_tools(str(path))
    assert sys.modules.get("verl") is verl_before  # verl's import resolved to ours only while the file ran
    assert list(tools) == ["add", "lookup", "fail"]
    assert tools["add"].schema["function"]["parameters"] == {
        "type": "object", "properties": {"a": {"type": "integer", "description": "The first number."},
                                         "b": {"type": "integer", "description": "The second number."}},
        "required": ["a", "b"]}
    assert tools["lookup"].schema["function"]["description"] == "The capital of a country."
    assert tools["add"].execute({"a": 2, "b": 40}) == ToolOutput("42")
    # An async function's (response, reward, metrics): its response, as JSON, and its reward.
    lookup = tools["lookup"].execute({"country": "France"})
    assert json.loads(lookup.text) == {"country": "France", "capital": "Paris"} and lookup.reward == 1.0
    # Through the turn loop: a raising function is the model's observation, counted.
    end = "<|im_end|>"
    model = ScriptedModel(smol_tokenizer, {"A": [f"{call('add', a=1, b=2)}{end}", f"{call('fail')}{end}", f"3{end}"]})
    (t,) = make_loop(smol_tokenizer, tools, 400).run(model, [smol_tokenizer.encode("A")], {})
    text = smol_tokenizer.decode(t.tokens)
    assert "tool\n3" in text and "fail failed: RuntimeError: the service is down" in text
    assert (t.tool_calls, t.tool_errors, t.tool_rewards) == (2, 1, [0.0, 0.0])


def test_function_tools_sit_beside_the_tool_config_and_bad_files_are_named(tmp_path, smol_tokenizer):
    path = tmp_path / "tools.py"
    path.write_text(FUNCTION_TOOLS)
    config = write_tool_config(tmp_path / "tools.yaml", {"class_name": "calculator"})
    setup = agent.setup(multi_turn_cfg(config, function_tool_path=str(path)), smol_tokenizer, None)
    assert sorted(setup.tools) == ["add", "calculator", "fail", "lookup"]
    assert '"name": "add"' in setup.system_prompt  # described to the model like the others
    clash = write_tool_config(tmp_path / "clash.yaml", {"class_name": "tests.test_multi_turn.Echo",
                                                        "tool_schema": {"type": "function", "function": {"name": "add"}}})
    with pytest.raises(ToolConfigError, match="both define add"):
        agent.setup(multi_turn_cfg(clash, function_tool_path=str(path)), smol_tokenizer, None)
    for text, message in [("def f(): pass\n", "defines no @function_tool function"),
                          ("from hybrid_rl.agent import function_tool\n@function_tool\ndef f(x):\n    return x\n",
                           "schema of .*f cannot be inferred"),
                          ("import nowhere\n", "failed to load: ModuleNotFoundError")]:
        (tmp_path / "bad.py").write_text(text)
        with pytest.raises(ToolConfigError, match=message):
            agent.load_function_tools(str(tmp_path / "bad.py"))
    with pytest.raises(ToolConfigError, match="no such file"):
        agent.load_function_tools(str(tmp_path / "missing.py"))


# ---------------------------------------------------------------------------------- chat templates
def tool_messages(*texts):
    return [{"role": "tool", "content": text} for text in texts]


def test_inserted_turn_tokens_come_from_the_chat_template(smol_tokenizer):
    chat = ChatTurns(smol_tokenizer)
    after_stop = smol_tokenizer.decode(chat.inserted_turn(tool_messages("42"), "<|im_end|>"))
    assert after_stop == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    # A turn cut after its tool call is closed first.
    assert smol_tokenizer.decode(chat.inserted_turn(tool_messages("42", "Error: x"), "")) == (
        "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>tool\nError: x<|im_end|>\n<|im_start|>assistant\n")
    user = smol_tokenizer.decode(chat.inserted_turn([{"role": "user", "content": "Try again."}], "<|im_end|>"))
    assert user == "\n<|im_start|>user\nTry again.<|im_end|>\n<|im_start|>assistant\n"


def test_templates_that_cannot_show_tools_are_refused_with_the_fix(smol_tokenizer, make_tokenizer, tmp_path):
    path = write_tool_config(tmp_path / "tools.yaml", {"class_name": "calculator"})
    with pytest.raises(MultiTurnError, match="describe_tools=system"):
        agent.setup(multi_turn_cfg(path, describe_tools="template"), smol_tokenizer, {})
    system = agent.setup(multi_turn_cfg(path), smol_tokenizer, {})
    assert '"name": "calculator"' in system.system_prompt and "tools" not in system.chat_template_kwargs
    with_tools = make_tokenizer(
        "{% if tools %}<|system|>{% for t in tools %}{{ t.function.name }} {% endfor %}<eos>{% endif %}"
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    listed = agent.setup(multi_turn_cfg(path, describe_tools="template"), with_tools, {})
    assert listed.system_prompt is None and listed.chat_template_kwargs["tools"][0]["function"]["name"] == "calculator"
    no_tool_role = make_tokenizer("{% for m in messages %}{% if m['role'] != 'tool' %}<|{{ m['role'] }}|>"
                                  "{{ m['content'] }}<eos>{% endif %}{% endfor %}"
                                  "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    with pytest.raises(MultiTurnError, match="does not render a tool message"):
        ChatTurns(no_tool_role)


# --------------------------------------------------------------------------------------- turn loop
class ScriptedModel:
    """Stands in for the engine where a test chooses what the model writes: each row's turns are
    scripted texts, returned as token ids (cut at the row's budget and after a stop text, as vLLM
    cuts them) with made-up log-probs."""

    def __init__(self, tokenizer, scripts: dict[str, list[str]]):
        self.tokenizer = tokenizer
        self.scripts = {tuple(tokenizer.encode(prompt)): list(turns) for prompt, turns in scripts.items()}
        self.calls = 0

    def generate_ids(self, prompts, settings, max_tokens, stop=None, stop_token_ids=None):
        self.calls += 1
        self.stops = (stop, stop_token_ids)
        tokens, log_probs = [], []
        for context, limit in zip(prompts, max_tokens):
            turns = next(turns for prompt, turns in self.scripts.items() if tuple(context[:len(prompt)]) == prompt)
            text = turns.pop(0)
            for s in stop or []:
                text = text[:text.index(s) + len(s)] if s in text else text
            ids = self.tokenizer.encode(text)[:limit]
            ends = [k for k, token in enumerate(ids) if token in (stop_token_ids or [])]
            ids = ids[:ends[0] + 1] if ends else ids
            tokens.append(ids)
            log_probs.append([-0.25] * len(ids))
        return tokens, log_probs


def make_loop(tokenizer, tools, response_length=200, interactions=None, chat_template_kwargs=None, **overrides):
    cfg = multi_turn_cfg("unused", **overrides).multi_turn
    return agent.MultiTurnRollout(cfg, tokenizer, tools, [tokenizer.eos_token_id], response_length,
                                  chat_template_kwargs, interactions=interactions)


def test_trajectories_interleave_sampled_turns_and_masked_tool_turns(smol_tokenizer):
    tok = smol_tokenizer
    end = "<|im_end|>"
    model = ScriptedModel(tok, {
        "A": [f"Let me compute. {call('calculator', expression='347 + 288')}{end}", f"635{end}"],
        "B": [f"12{end}"],
        # Writes on past its call: the turn is cut right after it.
        "C": [f"{call('calculator', expression='2 * 21')} and then more text{end}", f"42{end}"],
    })
    loop = make_loop(tok, {"calculator": agent.Calculator()})
    prompts = [tok.encode(p) for p in "ABC"]
    trajectories = loop.run(model, prompts, {})
    a, b, c = trajectories
    assert tok.decode(a.tokens) == (f"Let me compute. {call('calculator', expression='347 + 288')}{end}"
                                    f"\n<|im_start|>tool\n635{end}\n<|im_start|>assistant\n635{end}")
    assert (a.assistant_turns, a.tool_turns, a.tool_calls, a.tool_errors) == (2, 1, 1, 0)
    # Loss mask and log-probs: 1 / sampled values on the model's tokens, 0 on the inserted tool
    # turn. The engine stops right after the call, so the turn's end is inserted too.
    first = len(tok.encode(f"Let me compute. {call('calculator', expression='347 + 288')}"))
    inserted = len(tok.encode(f"{end}\n<|im_start|>tool\n635{end}\n<|im_start|>assistant\n"))
    assert a.loss_mask == [1] * first + [0] * inserted + [1] * (len(a.tokens) - first - inserted)
    assert all((lp == -0.25) == bool(m) for lp, m in zip(a.log_probs, a.loss_mask))
    assert tok.decode(b.tokens) == f"12{end}" and b.loss_mask == [1] * len(b.tokens) and b.assistant_turns == 1
    assert tok.decode(c.tokens) == (f"{call('calculator', expression='2 * 21')}"
                                    f"{end}\n<|im_start|>tool\n42{end}\n<|im_start|>assistant\n42{end}")
    assert model.calls == 2  # the rows generate together, turn by turn

    batch = Batch(tensors={"input_ids": torch.ones(3, 4, dtype=torch.long),
                           "attention_mask": torch.ones(3, 4, dtype=torch.long)})
    out = assemble_rollout(batch, [t.tokens for t in trajectories], [t.log_probs for t in trajectories], 200,
                           tok.pad_token_id, [tok.eos_token_id], loss_masks=[t.loss_mask for t in trajectories])
    # The whole trajectory is attended to (and scored at its end); only the model's tokens are trained.
    assert out.response_lengths().tolist() == [len(t.tokens) for t in trajectories]
    assert out["response_mask"][0].tolist() == a.loss_mask + [0] * (200 - len(a.tokens))
    assert out["rollout_log_probs"][0, first:first + inserted].abs().sum() == 0


def test_turn_limits_budget_and_failing_tools_end_or_continue_trajectories(smol_tokenizer):
    tok = smol_tokenizer
    end = "<|im_end|>"
    again = f"{call('echo', text='x')}{end}"
    tools = {"echo": Echo(), "sleeper": Sleeper(), "crasher": Crasher()}
    # max_assistant_turns: the third call is never executed.
    loop = make_loop(tok, tools, max_assistant_turns=3)
    (t,) = loop.run(ScriptedModel(tok, {"A": [again] * 5}), [tok.encode("A")], {})
    assert (t.assistant_turns, t.tool_turns, t.tool_calls) == (3, 2, 2) and t.loss_mask[-1] == 1
    # max_user_turns counts tool turns.
    (t,) = make_loop(tok, tools, max_user_turns=1).run(ScriptedModel(tok, {"A": [again] * 5}), [tok.encode("A")], {})
    assert (t.assistant_turns, t.tool_turns) == (2, 1)
    # The response budget: turns stop when it is spent, and a tool turn that does not fit is left out.
    (t,) = make_loop(tok, tools, response_length=40).run(ScriptedModel(tok, {"A": [again] * 9}), [tok.encode("A")], {})
    assert len(t.tokens) <= 40 and t.loss_mask[-1] == 1
    # Malformed JSON, an unknown tool, a crashing tool, a hanging tool: each is answered with an
    # error the model reads next turn, counted, and the trajectory goes on.
    model = ScriptedModel(tok, {"A": [f'<tool_call>{{"name": "echo", "arguments": {{"text": }}</tool_call>{end}',
                                      f"{call('search', q='x')}{end}", f"{call('crasher')}{end}",
                                      f"{call('sleeper')}{end}", f"done{end}"]})
    start = time.monotonic()
    (t,) = make_loop(tok, tools, 400, tool_timeout_s=1).run(model, [tok.encode("A")], {})
    assert time.monotonic() - start < 10
    assert (t.assistant_turns, t.tool_calls, t.tool_errors) == (5, 3, 4)
    text = tok.decode(t.tokens)
    for fragment in ["not valid JSON", "no tool named 'search'", "crasher failed: RuntimeError: the tool has a bug",
                     "did not answer within 1 s"]:
        assert fragment in text
    # max_parallel_calls: only the first calls of a turn run; long outputs are cut.
    loop = make_loop(tok, tools, max_parallel_calls=2, max_tool_response_length=6, tool_response_truncate_side="left")
    model = ScriptedModel(tok, {"A": [call("echo", text="abcdefghij") + call("echo", text="b") + call("echo", text="c")
                                      + end, f"ok{end}"]})
    (t,) = loop.run(model, [tok.encode("A")], {})
    text = tok.decode(t.tokens)
    assert t.tool_calls == 2 and "abcdef...(truncated)" in text and "tool\nb<|im_end|>" in text and "tool\nc" not in text


# ------------------------------------------------------------------------ verl's agent loops by row
class ScriptedEngine(ScriptedModel):
    """The scripted model behind the engine interface ``generate_batch`` uses."""

    dp_rank, routes = 0, None

    def generate(self, batch, settings, response_length):
        from hybrid_rl.workers.rollout import prompt_token_lists

        prompts = prompt_token_lists(batch)
        return self.generate_ids(prompts, settings, [response_length] * len(prompts))


def test_rows_pick_their_agent_loop_and_every_row_gets_the_tool_loops_columns(smol_tokenizer):
    """verl's ``agent_name`` column: single_turn_agent rows generate once (a call they write is not
    run), tool_agent rows and rows without a name run the tool loop; the batch keeps its order."""
    from hybrid_rl.config_keys import compose_config
    from hybrid_rl.data import collate_prompts
    from hybrid_rl.protocol import BatchMeta, Sampling
    from hybrid_rl.workers.rollout import generate_batch

    tok, end = smol_tokenizer, "<|im_end|>"
    cfg = compose_config(["actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
                          "data.max_response_length=120"])
    assert cfg.actor_rollout_ref.rollout.multi_turn.enable  # tool_agent is the tool loop
    asks = f"{call('calculator', expression='2 * 21')}{end}"
    scripts = {"A": [asks, f"42{end}"], "B": [asks, f"42{end}"], "C": [asks, f"42{end}"]}
    names = ["single_turn_agent", "tool_agent", None]
    rows = [{"prompt_ids": tok.encode(p), "raw_prompt": [{"role": "user", "content": p}],
             "extra_info": {"index": i}, "agent_name": name, "index": i}
            for i, (p, name) in enumerate(zip("ABC", names))]
    for order in ([0, 1, 2], [1, 2, 0], [0]):
        prompts = collate_prompts([rows[i] for i in order], tok.pad_token_id, 8)
        prompts.meta = BatchMeta(sampling=Sampling.TRAIN, step=1)
        engine = ScriptedEngine(tok, {k: list(v) for k, v in scripts.items()})
        out = generate_batch(engine, make_loop(tok, {"calculator": agent.Calculator()}, 120), cfg, prompts,
                             tok.pad_token_id, [tok.eos_token_id])
        texts = [tok.decode(r[m.bool()]) for r, m in zip(out["responses"], out["attention_mask"][:, 8:])]
        for i, text, calls, turns in zip(order, texts, out["multi_turn_tool_calls"].tolist(),
                                         out["multi_turn_assistant_turns"].tolist()):
            if names[i] == "single_turn_agent":
                assert (text, calls, turns) == (asks, 0, 1)
            else:
                assert text.endswith(f"tool\n42{end}\n<|im_start|>assistant\n42{end}") and (calls, turns) == (1, 2)
        # verl's num_turns: prompt and answer; prompt, call, tool answer, answer.
        assert out["num_turns"].tolist() == [2 if names[i] == "single_turn_agent" else 4 for i in order]
        assert [info["index"] for info in out["extra_info"]] == order
        assert all(info["tool_rewards"] in ([], [0.0]) for info in out["extra_info"])


def test_agent_names_of_the_data_are_checked_at_start(tmp_path, smol_tokenizer):
    from hybrid_rl.config import ConfigError, validate_config
    from hybrid_rl.config_keys import compose_config
    from hybrid_rl.data import RLDataset
    from hybrid_rl.data.arithmetic import make_arithmetic_rows, write_rows

    rows = make_arithmetic_rows(3, seed=0)
    for row, name in zip(rows, ["tool_agent", None, "single_turn_agent"]):
        row["agent_name"] = name
    dataset = RLDataset(write_rows(str(tmp_path / "a.parquet"), rows), smol_tokenizer)
    assert dataset.agent_names() == ["tool_agent", None, "single_turn_agent"]
    on = compose_config(["actor_rollout_ref.rollout.multi_turn.enable=true"]).actor_rollout_ref.rollout
    off = compose_config([]).actor_rollout_ref.rollout
    # multi_turn.enable makes the tool loop the default, as in verl before its agent loops.
    assert agent.row_agent_names(dataset.agent_names(), on) == ["tool_agent", "tool_agent", "single_turn_agent"]
    assert agent.row_agent_names(dataset.agent_names(), off) == ["tool_agent", "single_turn_agent", "single_turn_agent"]
    agent.check_agent_names(dataset.agent_names(), on, (), files="a.parquet")
    with pytest.raises(ToolConfigError, match="row 0: agent_name=tool_agent, but the tool loop is off"):
        agent.check_agent_names(dataset.agent_names(), off, (), files="a.parquet")
    with pytest.raises(ToolConfigError, match="row 1: agent_name='react_agent' is not an agent loop here"):
        agent.check_agent_names([None, "react_agent"], on, (), files="a.parquet")
    agent.check_agent_names([None, "react_agent"], on, ("react_agent",), files="a.parquet")
    with pytest.raises(ConfigError, match="default_agent_loop='react_agent' is not valid"):
        validate_config(compose_config(["actor_rollout_ref.rollout.agent.default_agent_loop=react_agent"]))
    rows[0]["agent_name"] = 3
    with pytest.raises(ValueError, match="row 0 of .*: agent_name is 3"):
        RLDataset(write_rows(str(tmp_path / "b.parquet"), rows[:1]), smol_tokenizer)


# ----------------------------------------------------------------------------------- gpt-oss format
# A harmony chat template written here after the rules of gpt-oss's own: a call is rendered from
# the assistant message's tool_calls and ends with <|call|>; a tool message is named after the
# last call and carries its content as a JSON string; an answer ends with <|end|> in the history
# and with <|return|> when it is the last message of a training example.
HARMONY_TEMPLATE = (
    "{%- set ns = namespace(last=none) -%}"
    "<|start|>system<|message|>Reasoning: medium<|end|>"
    "{%- if tools -%}<|start|>developer<|message|># Tools\n{% for t in tools %}{{ t.function.name }}\n"
    "{% endfor %}<|end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' and m.tool_calls -%}{%- set call = m.tool_calls[0].function -%}"
    "{%- set ns.last = call.name -%}"
    "<|start|>assistant to=functions.{{ call.name }}<|channel|>commentary json<|message|>"
    "{{ call.arguments | tojson }}<|call|>"
    "{%- elif m.role == 'assistant' -%}<|start|>assistant<|channel|>final<|message|>{{ m.content }}"
    "{{ '<|return|>' if loop.last and not add_generation_prompt else '<|end|>' }}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if ns.last is none -%}{{ raise_exception('a tool message without an assistant tool call') }}{%- endif -%}"
    "<|start|>functions.{{ ns.last }} to=assistant<|channel|>commentary<|message|>{{ m.content | tojson }}<|end|>"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}")
HARMONY_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>"]


@pytest.fixture(scope="module")
def harmony_tokenizer():
    """The default model's tokenizer with harmony's special tokens and a harmony chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_path(None))
    tok.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    tok.chat_template = HARMONY_TEMPLATE
    tok.eos_token = "<|return|>"
    return tok


GPT_OSS_CALL = "<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{args}<|call|>"


def test_gpt_oss_calls_are_parsed_from_harmony_messages():
    gpt_oss = agent.GptOss(None)
    thought = "<|channel|>analysis<|message|>I should add; a call to=functions.python would be slower.<|end|>"
    calls, errors = gpt_oss.parse(thought + "<|start|>assistant" +
                                  GPT_OSS_CALL.format(name="calculator", args='{"expression": "2+3"}'))
    assert [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": "2+3"})] and errors == []
    # The recipient may also stand in the header before the channel (after the prompt's <|start|>assistant).
    calls, errors = gpt_oss.parse(' to=functions.python<|channel|>commentary json<|message|>{"code": "print(1)"}<|call|>')
    assert [(c.name, c.arguments) for c in calls] == [("python", {"code": "print(1)"})] and errors == []
    assert gpt_oss.parse(thought + "<|start|>assistant<|channel|>final<|message|>5<|return|>") == ([], [])
    assert gpt_oss.ends_with_call(GPT_OSS_CALL.format(name="x", args="{}"))
    assert not gpt_oss.ends_with_call("<|channel|>final<|message|>5<|return|>")
    for text, fragment in [(GPT_OSS_CALL.format(name="calculator", args='{"expression": }'), "not valid JSON"),
                           (GPT_OSS_CALL.format(name="calculator", args="[1]"), "JSON object"),
                           ('<|channel|>commentary to=browser.search<|message|>{"q": "x"}<|call|>', "not a function tool"),
                           ("<|channel|>commentary<|message|>{}<|call|>", "names no recipient")]:
        calls, errors = gpt_oss.parse(text)
        assert calls == [] and len(errors) == 1 and fragment in errors[0], (text, errors)


def test_gpt_oss_tool_turns_come_from_the_harmony_template(harmony_tokenizer):
    tok = harmony_tokenizer
    gpt_oss = agent.GptOss(tok)
    chat = ChatTurns(tok, {}, gpt_oss)
    text = "<|channel|>analysis<|message|>Add.<|end|><|start|>assistant" + GPT_OSS_CALL.format(
        name="calculator", args='{"expression": "40 + 2"}')
    calls, _ = gpt_oss.parse(text)
    tool_turn = tok.decode(chat.inserted_turn(tool_messages("42"), "<|call|>", gpt_oss.call_message(text, calls)))
    assert tool_turn == '<|start|>functions.calculator to=assistant<|channel|>commentary<|message|>"42"<|end|><|start|>assistant'
    # After an answer (which the model ends with <|return|>), the user's reply.
    user = tok.decode(chat.inserted_turn([{"role": "user", "content": "Try again."}], "<|return|>"))
    assert user == "<|start|>user<|message|>Try again.<|end|><|start|>assistant"
    assert gpt_oss.answer(tok.encode("<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final"
                                     "<|message|>42<|return|>")) == "42"
    # The Hermes format cannot render tool turns with this template, nor gpt-oss with ChatML.
    with pytest.raises(MultiTurnError, match="fails to render a tool message"):
        ChatTurns(tok, {})


def test_gpt_oss_trajectories_call_tools_and_mask_their_answers(harmony_tokenizer, smol_tokenizer):
    tok = harmony_tokenizer
    call_id = tok.convert_tokens_to_ids("<|call|>")
    first = ("<|channel|>analysis<|message|>Use the tool.<|end|><|start|>assistant"
             + GPT_OSS_CALL.format(name="calculator", args='{"expression": "347 + 288"}'))
    model = ScriptedModel(tok, {
        "A": [first + "<|start|>assistant<|channel|>final<|message|>wrote on<|return|>",
              "<|channel|>final<|message|>635<|return|>"],
        "B": [GPT_OSS_CALL.format(name="calculator", args='{"expression": }'),
              GPT_OSS_CALL.format(name="search", args='{"q": "x"}'), "<|channel|>final<|message|>7<|return|>"],
    })
    loop = make_loop(tok, {"calculator": agent.Calculator()}, format="gpt-oss", describe_tools="template",
                     chat_template_kwargs={"tools": [agent.Calculator().schema]})
    a, b = loop.run(model, [tok.encode(p) for p in "AB"], {})
    # The engine stops on <|call|> (added to the EOS ids) and is given no stop texts.
    assert model.stops == (None, sorted({tok.eos_token_id, call_id}))
    tool_turn = '<|start|>functions.calculator to=assistant<|channel|>commentary<|message|>"635"<|end|><|start|>assistant'
    assert tok.decode(a.tokens) == first + tool_turn + "<|channel|>final<|message|>635<|return|>"
    assert (a.assistant_turns, a.tool_turns, a.tool_calls, a.tool_errors) == (2, 1, 1, 0)
    sampled, inserted = len(tok.encode(first)), len(tok.encode(tool_turn))
    assert a.loss_mask == [1] * sampled + [0] * inserted + [1] * (len(a.tokens) - sampled - inserted)
    text = tok.decode(b.tokens)
    assert (b.assistant_turns, b.tool_calls, b.tool_errors) == (3, 1, 2)
    assert '<|start|>functions.calculator to=assistant<|channel|>commentary<|message|>"Error: the arguments' in text
    assert "<|start|>functions.search to=assistant" in text and "no tool named 'search'" in text
    with pytest.raises(MultiTurnError, match="needs the special token <\\|call\\|>"):
        make_loop(smol_tokenizer, {}, format="gpt-oss")


# ----------------------------------------------------------------------------------------- the loss
def test_tool_tokens_do_not_enter_the_loss(tiny_model_dir):
    """The policy loss of a trajectory ending in a tool turn is the same whatever the tool wrote,
    and whatever advantages or old log-probs its positions carry; with a mask of all ones it is not."""
    from transformers import AutoModelForCausalLM

    from hybrid_rl.algorithms import get_policy_loss, token_log_probs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    cfg = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0,
                            "policy_loss": {"loss_mode": "vanilla"}})
    loss_fn = get_policy_loss("vanilla")
    torch.manual_seed(0)
    prompt = torch.randint(5, 300, (1, 6))
    sampled = torch.randint(5, 300, (1, 8))
    mask = torch.tensor([[1] * 8 + [0] * 6])

    @torch.no_grad()
    def loss(tool_tokens, advantages, old, response_mask):
        responses = torch.cat([sampled, tool_tokens], dim=1)
        logits = model(torch.cat([prompt, responses], dim=1)).logits[:, prompt.shape[1] - 1:-1]
        log_prob = token_log_probs(logits.float(), responses)
        return float(loss_fn(old, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=cfg)[0])

    adv, old = torch.randn(1, 14), -torch.rand(1, 14)
    tool_a, tool_b = torch.randint(5, 300, (1, 6)), torch.randint(5, 300, (1, 6))
    base = loss(tool_a, adv, old, mask)
    assert loss(tool_b, adv, old, mask) == base
    other_adv, other_old = adv.clone(), old.clone()
    other_adv[:, 8:], other_old[:, 8:] = 100.0, -50.0
    assert loss(tool_a, other_adv, other_old, mask) == base
    everything = torch.ones_like(mask)
    assert loss(tool_b, adv, old, everything) != loss(tool_a, adv, old, everything)


# ------------------------------------------------------------------------------------ whole runs
def test_config_refuses_what_the_tool_loop_cannot_do(tmp_path):
    from hybrid_rl.config import ConfigError, validate_config
    from hybrid_rl.config_keys import compose_config

    on = ["actor_rollout_ref.rollout.multi_turn.enable=true"]
    for extra, message in [(["actor_rollout_ref.rollout.name=hf"], "rollout.name=vllm"),
                           (["actor_rollout_ref.rollout.beam_search=true"], "cannot be combined"),
                           (["actor_rollout_ref.rollout.multi_turn.max_assistant_turns=0"], "must be >= 1"),
                           (["actor_rollout_ref.rollout.multi_turn.tool_timeout_s=0"], "must be > 0"),
                           (["actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=top"], "not valid"),
                           (["actor_rollout_ref.rollout.multi_turn.format=llama3_json"], "formats hermes, gpt-oss")]:
        with pytest.raises(ConfigError, match=message):
            validate_config(compose_config(on + extra))


def test_bad_tool_configs_stop_the_driver_before_workers_start(tmp_path):
    from hybrid_rl.config_keys import compose_config
    from hybrid_rl.main import SetupError, checked_trainer

    base = ["actor_rollout_ref.rollout.multi_turn.enable=true", "actor_rollout_ref.rollout.multi_turn.describe_tools=system"]
    bad = write_tool_config(tmp_path / "tools.yaml", {"class_name": "search"})
    for extra, message in [([], "needs actor_rollout_ref.rollout.multi_turn.tool_config_path"),
                           ([f"actor_rollout_ref.rollout.multi_turn.tool_config_path={bad}"], "unknown tool 'search'"),
                           ([f"actor_rollout_ref.rollout.multi_turn.tool_config_path={bad}",
                             "actor_rollout_ref.rollout.multi_turn.describe_tools=listing"], "must be one of")]:
        with pytest.raises(SetupError, match=message):
            checked_trainer(compose_config(base + extra))


CALCULATOR_HINT = (' Use the calculator: write <tool_call>{{"name": "calculator", "arguments": {{"expression": '
                   '"{a} {op} {b}"}}}}</tool_call>, read its answer, then reply with only the final number.')


@pytest.mark.slow
def test_default_model_calls_the_calculator_through_the_driver(ray_session, tmp_path, monkeypatch):
    """The default model, told how, calls the calculator in most greedy validation answers; the
    engine's log-probs of the trained tokens match the trainer's, so the tool turns sit where the
    engine saw them; the rollout traces hold each engine and tool call."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")  # recorded, so that teardown unsets what mlflow sets
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    from hybrid_rl.config_keys import compose_config
    from hybrid_rl.data.arithmetic import make_arithmetic_rows, write_rows
    from hybrid_rl.main import build_trainer

    rows = make_arithmetic_rows(16, seed=3, lo=100, hi=999)
    for row in rows:
        row["prompt"][0]["content"] = (f"Calculate {row['extra_info']['a']} {row['extra_info']['op']} "
                                       f"{row['extra_info']['b']}." + CALCULATOR_HINT.format(**row["extra_info"]))
    data = write_rows(str(tmp_path / "calc.parquet"), rows)
    tools = write_tool_config(tmp_path / "tools.yaml", {"class_name": "calculator"})
    cfg = compose_config([
        f"data.train_files={data}", f"data.val_files={data}", "data.max_prompt_length=384",
        "data.max_response_length=64", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.total_training_steps=1", "trainer.test_freq=-1",
        "actor_rollout_ref.actor.use_kl_loss=false",  # no reference model: the tool turns are what is tested
        f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.logger=[jsonl]", "trainer.progress_bar=false",
        f"trainer.validation_data_dir={tmp_path / 'val'}", "trainer.final_model_dir=null",
        "actor_rollout_ref.actor.fsdp_config.dtype=fp32", "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.multi_turn.enable=true", f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
        "actor_rollout_ref.rollout.multi_turn.describe_tools=system",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
        "actor_rollout_ref.rollout.trace.backend=mlflow", "actor_rollout_ref.rollout.trace.project_name=proj",
        "actor_rollout_ref.rollout.trace.token2text=true",
        "actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker=4",
    ])
    trainer = build_trainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    lines = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    val, step = lines[0], lines[-1]
    assert val["val/multi_turn/tool_call_share"] >= 0.5 and val["val/multi_turn/tool_errors/mean"] == 0
    assert val["val-core/arithmetic/tool_call/mean@1"] == val["val/multi_turn/tool_call_share"]
    assert step["step"] == 1 and "multi_turn/tool_call_share" in step
    assert step["rollout_corr/abs_logp_diff_max"] < 1e-3
    answers = [json.loads(line)["output"] for line in open(tmp_path / "val" / "0.jsonl")]
    calculator = agent.Calculator()
    checked = 0
    for output in answers:
        calls, _ = agent.Hermes(None).parse(output)
        if calls:  # the calculator's answer follows the call in the text the reward read
            assert f"tool\n{calculator.execute(calls[0].arguments).text}\n" in output, output
            checked += 1
    assert checked >= len(answers) // 2
    # The rollout traces (trace.*): four validation prompts, then both responses of the step's two.
    from tests.test_rollout_trace import traces

    written = traces(tmp_path)
    assert [(tags["step"], tags["validate"]) for tags, _, _ in written] == [("0", "True")] * 4 + [("1", "False")] * 4
    tool_spans = [span for _, _, children in written for span in children if span.name == "tool calculator"]
    assert tool_spans and all(span.outputs["text"] == calculator.execute(span.inputs).text for span in tool_spans)
    for _, root, children in written:  # the spans cover the response: sampled turns and the tool turns between
        sampled = [token for span in children if span.name == "generate" for token in span.outputs["token_ids"]]
        assert len(sampled) <= len(root.outputs["response_ids"]) and set(sampled) <= set(root.outputs["response_ids"])
