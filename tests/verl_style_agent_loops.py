"""Agent loops written against verl's agent-loop interface, as a verl user writes them (imports of
verl's modules, ``@register``, ``AgentLoopOutput``), for tests/test_verl_agent_loops.py. They load
only through hybrid_rl's stand-ins for those modules."""

import json
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register
from verl.experimental.agent_loop.tool_parser import ToolParser
from verl.tools.utils.tool_registry import initialize_tools_from_config
from verl.utils.profiler import simple_timer


@register("second_look")
class SecondLookAgentLoop(AgentLoopBase):
    """Answers, is asked to look again (a user turn the loss does not see), and answers again."""

    def __init__(self, *args, nudge="Look again at the question and answer with only the number.", **kwargs):
        super().__init__(*args, **kwargs)
        self.nudge = nudge
        self.response_length = self.config.actor_rollout_ref.rollout.response_length

    async def run(self, sampling_params, **kwargs):
        messages = list(kwargs["raw_prompt"])
        prompt_ids = await self.apply_chat_template(messages)
        metrics, response_ids, response_mask, log_probs = {}, [], [], []
        with simple_timer("generate_sequences", metrics):
            first = await self.server_manager.generate(request_id=uuid4().hex, prompt_ids=prompt_ids,
                                                       sampling_params=sampling_params)
        response_ids += first.token_ids
        response_mask += [1] * len(first.token_ids)
        log_probs += first.log_probs
        nudge = await self.apply_chat_template([{"role": "user", "content": self.nudge}], remove_system_prompt=True)
        response_ids += nudge
        response_mask += [0] * len(nudge)
        log_probs += [0.0] * len(nudge)
        if len(response_ids) < self.response_length:
            second = await self.server_manager.generate(
                request_id=uuid4().hex, prompt_ids=prompt_ids + response_ids,
                sampling_params={**sampling_params, "max_tokens": self.response_length - len(response_ids)})
            response_ids += second.token_ids
            response_mask += [1] * len(second.token_ids)
            log_probs += second.log_probs
        n = self.response_length
        return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=response_ids[:n], response_mask=response_mask[:n],
                               response_logprobs=log_probs[:n], num_turns=len(messages) + 3, metrics=metrics,
                               extra_fields={"first_answer": self.tokenizer.decode(first.token_ids,
                                                                                   skip_special_tokens=True)})


class ToolFirstAgentLoop(AgentLoopBase):
    """Calls the first tool of data.tool_config_path with the row's extra_info.expression, shows
    the answer as a tool turn, then lets the model answer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tools = initialize_tools_from_config(self.config.data.tool_config_path)

    async def run(self, sampling_params, **kwargs):
        messages = list(kwargs["raw_prompt"])
        tool = self.tools[0]
        instance_id, _ = await tool.create()
        response, reward, _ = await tool.execute(instance_id, {"expression": kwargs["extra_info"]["expression"]})
        await tool.release(instance_id)
        messages.append({"role": "tool", "content": response.text})
        prompt_ids = await self.apply_chat_template(messages)
        out = await self.server_manager.generate(request_id=uuid4().hex, prompt_ids=prompt_ids,
                                                 sampling_params=sampling_params)
        return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=out.token_ids,
                               response_mask=[1] * len(out.token_ids), response_logprobs=out.log_probs,
                               num_turns=len(messages) + 1, metrics={}, extra_fields={"tool_reward": reward})


class NoLogProbsAgentLoop(AgentLoopBase):
    """Drops the log-probs, which the trainer needs."""

    async def run(self, sampling_params, **kwargs):
        prompt_ids = await self.apply_chat_template(list(kwargs["raw_prompt"]))
        out = await self.server_manager.generate(request_id="x", prompt_ids=prompt_ids, sampling_params=sampling_params)
        return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=out.token_ids, response_mask=[1] * len(out.token_ids),
                               metrics={})


class BeamAgentLoop(AgentLoopBase):
    """Asks for a sampling setting the engine does not take."""

    async def run(self, sampling_params, **kwargs):
        prompt_ids = await self.apply_chat_template(list(kwargs["raw_prompt"]))
        await self.server_manager.generate(request_id="x", prompt_ids=prompt_ids,
                                           sampling_params={**sampling_params, "use_beam_search": True})


class SelfScoringAgentLoop(AgentLoopBase):
    """Scores its own answer, as verl's SWE-style loops do: 1.0 when it is "1", else 0.0."""

    async def run(self, sampling_params, **kwargs):
        prompt_ids = await self.apply_chat_template(list(kwargs["raw_prompt"]))
        out = await self.server_manager.generate(request_id="x", prompt_ids=prompt_ids, sampling_params=sampling_params)
        answer = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=out.token_ids, response_mask=[1] * len(out.token_ids),
                               response_logprobs=out.log_probs, reward_score=1.0 if answer == "1" else 0.0,
                               num_turns=2, metrics={})


class ReactAgentLoop(AgentLoopBase):
    """The usual tool loop of a verl user: parse the turn's calls with verl's hermes parser, run
    them on the tools of data.tool_config_path, append the answers as tool messages, go on."""

    def __init__(self, *args, max_turns=3, **kwargs):
        super().__init__(*args, **kwargs)
        self.tools = {tool.name: tool for tool in initialize_tools_from_config(self.config.data.tool_config_path)}
        self.parser = ToolParser.get_tool_parser("hermes", self.tokenizer)
        self.max_turns = max_turns

    async def run(self, sampling_params, **kwargs):
        schemas = [tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True) for tool in self.tools.values()]
        prompt_ids = await self.apply_chat_template(list(kwargs["raw_prompt"]), tools=schemas)
        response_ids, response_mask, log_probs, calls_made = [], [], [], 0
        for _ in range(self.max_turns):
            out = await self.server_manager.generate(request_id=uuid4().hex, prompt_ids=prompt_ids + response_ids,
                                                     sampling_params=sampling_params)
            response_ids += out.token_ids
            response_mask += [1] * len(out.token_ids)
            log_probs += out.log_probs
            _, calls = await self.parser.extract_tool_calls(out.token_ids)
            if not calls:
                break
            answers = []
            for call in calls:
                tool = self.tools[call.name]
                instance_id, _ = await tool.create()
                response, _, _ = await tool.execute(instance_id, json.loads(call.arguments))
                await tool.release(instance_id)
                answers.append({"role": "tool", "content": response.text})
                calls_made += 1
            turn = await self.apply_chat_template(answers, remove_system_prompt=True)
            response_ids += turn
            response_mask += [0] * len(turn)
            log_probs += [0.0] * len(turn)
        return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=response_ids, response_mask=response_mask,
                               response_logprobs=log_probs, num_turns=2 + 2 * calls_made, metrics={},
                               extra_fields={"calls_made": calls_made})
