"""Rollout traces (hybrid_rl/rollout_trace.py, verl's rollout.trace.*): one MLflow trace per traced
response with verl's tags, a span per engine call and per tool call, the decoded text with
token2text, and max_samples_per_step_per_worker's choice of prompts."""

from __future__ import annotations

import re

import pytest
import torch
from omegaconf import OmegaConf

from hybrid_rl.protocol import Batch, BatchMeta, Sampling
from hybrid_rl.rollout_trace import ROOT_SPAN, RolloutTracer, Span, now_ns, rollout_tracer
from tests.test_multi_turn import ScriptedModel, call, make_loop, smol_tokenizer  # noqa: F401

END = "<|im_end|>"


@pytest.fixture(autouse=True)
def own_store(monkeypatch, tmp_path):
    """mlflow.set_tracking_uri also sets MLFLOW_TRACKING_URI, which would send later tests' traces
    (and a Ray started later, its workers') to this one's store: unset before and after. The
    working directory is the test's, to see what is written there."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")  # recorded, so that teardown restores the state before
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")


def trace_cfg(tmp_path, **trace):
    return OmegaConf.create({"trainer": {"default_local_dir": str(tmp_path / "run"), "seed": 1}, "actor_rollout_ref": {
        "rollout": {"trace": {"project_name": "proj", "experiment_name": "exp", "backend": "mlflow",
                              "token2text": False, "max_samples_per_step_per_worker": None, **trace}}}})


def traces(tmp_path):
    """The traces in the run folder's store, oldest first, as (tags, root span, child spans)."""
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'run'}/mlflow.db")
    experiment = mlflow.get_experiment_by_name("proj")
    found = mlflow.search_traces(locations=[experiment.experiment_id], return_type="list", order_by=["timestamp_ms"])
    out = []
    for trace in found:
        (root,) = [s for s in trace.data.spans if s.parent_id is None]
        children = sorted((s for s in trace.data.spans if s.parent_id is not None), key=lambda s: s.start_time_ns)
        out.append((trace.info.tags, root, children))
    return out


def batch(groups, n, step=3, indices=None):
    rows = [g for g in groups for _ in range(n)]
    prompts = Batch({"input_ids": torch.ones(len(rows), 2, dtype=torch.long),
                     "attention_mask": torch.ones(len(rows), 2, dtype=torch.long)},
                    meta=BatchMeta(step=step, sampling=Sampling.TRAIN))
    prompts["uid"] = rows
    if indices is not None:
        prompts["extra_info"] = [{"index": indices[groups.index(g)]} for g in rows]
    return prompts


def test_each_response_is_a_trace_with_verls_tags_and_its_engine_call(tmp_path, smol_tokenizer):
    tok = smol_tokenizer
    tracer = RolloutTracer(trace_cfg(tmp_path, token2text=True), tok, rank=0)
    prompts = batch(["a", "b"], n=2, indices=[17, 4])
    prompt_ids = [tok.encode("What is 2 + 2?")] * 2 + [tok.encode("What is 3 + 3?")] * 2
    tokens = [tok.encode(text) for text in ("4", "four", "6", "six")]
    log_probs = [[-0.5] * len(t) for t in tokens]
    start = now_ns() - 10**9  # a millisecond apart: MLflow orders traces by their start in milliseconds
    spans = [[Span("generate", start + k * 10**6, start + 10**8 + k, tokens=(0, len(t)))] for k, t in enumerate(tokens)]
    tracer.log(prompts, prompt_ids, tokens, log_probs, spans, validate=False)
    written = traces(tmp_path)
    assert len(written) == 4
    # MLflow keeps the spans in the store's tables or, by its own choice of the moment, as the
    # experiment's artifacts: those are in the run folder, and nothing is in the working directory.
    import mlflow

    artifacts = mlflow.get_experiment_by_name("proj").artifact_location
    assert artifacts.removeprefix("file://") == str(tmp_path / "run" / "mlartifacts")
    assert not any((tmp_path / "cwd").iterdir())
    for k, (tags, root, (generate,)) in enumerate(written):
        assert {key: tags[key] for key in ("step", "sample_index", "rollout_n", "validate", "experiment_name")} == {
            "step": "3", "sample_index": ["17", "17", "4", "4"][k], "rollout_n": str(k % 2), "validate": "False",
            "experiment_name": "exp"}
        assert root.name == ROOT_SPAN and root.inputs == {"prompt_ids": prompt_ids[k], "prompt_text": tok.decode(prompt_ids[k])}
        assert root.outputs == {"response_ids": tokens[k], "response_text": ["4", "four", "6", "six"][k]}
        assert generate.name == "generate" and generate.inputs["prompt_ids"] == prompt_ids[k]
        assert generate.outputs == {"token_ids": tokens[k], "token_text": root.outputs["response_text"],
                                    "log_probs": log_probs[k]}
        assert (generate.start_time_ns, generate.end_time_ns) == (start + k * 10**6, start + 10**8 + k)  # the call's times


def test_max_samples_per_step_per_worker_traces_all_responses_of_that_many_prompts(tmp_path, smol_tokenizer):
    tracer = RolloutTracer(trace_cfg(tmp_path, max_samples_per_step_per_worker=2), smol_tokenizer, rank=1)
    prompts = batch(["a", "b", "c", "d", "e"], n=3)
    chosen = tracer.traced_rows(prompts)
    groups = {prompts["uid"][row] for row, _, _ in chosen}
    assert len(groups) == 2 and len(chosen) == 6
    assert sorted(rollout_n for _, _, rollout_n in chosen) == [0, 0, 1, 1, 2, 2]
    assert all(index == "abcde".index(prompts["uid"][row]) for row, index, _ in chosen)  # the prompt's place
    assert tracer.traced_rows(prompts) == chosen  # drawn from (seed, step, rank): the same on a resumed run
    assert RolloutTracer(trace_cfg(tmp_path), smol_tokenizer, rank=1).traced_rows(prompts) == [
        (row, row // 3, row % 3) for row in range(15)]  # no limit: every response


def test_multi_turn_trajectories_trace_each_engine_call_and_each_tool_call(tmp_path, smol_tokenizer):
    from hybrid_rl import agent
    from tests.test_multi_turn import Sleeper

    tok = smol_tokenizer
    model = ScriptedModel(tok, {"A": [f"{call('calculator', expression='347 + 288')}{END}",
                                      f"{call('sleeper')}{END}", f"635{END}"]})
    loop = make_loop(tok, {"calculator": agent.Calculator(), "sleeper": Sleeper()}, 400, tool_timeout_s=1)
    (t,) = loop.run(model, [tok.encode("A")], {})
    assert [s.name for s in t.spans] == ["generate", "tool calculator", "generate", "tool sleeper", "generate"]
    sampled = [token for s in t.spans if s.tokens for token in t.tokens[s.tokens[0]:s.tokens[1]]]
    assert sampled == [token for token, trained in zip(t.tokens, t.loss_mask) if trained]  # the turns' own tokens
    calc, sleeper = t.spans[1], t.spans[3]
    assert calc.inputs == {"expression": "347 + 288"} and calc.outputs == {"text": "635", "reward": 0.0, "error": False}
    assert sleeper.outputs["error"] and "within 1 s" in sleeper.outputs["text"]
    assert 0.9e9 < sleeper.end_ns - sleeper.start_ns < 5e9  # until the call was given up on
    assert all(a.end_ns <= b.start_ns for a, b in zip(t.spans, t.spans[1:]))

    tracer = RolloutTracer(trace_cfg(tmp_path, token2text=True), tok, rank=0)
    tracer.log(batch(["a"], n=1), [tok.encode("A")], [t.tokens], [t.log_probs], [t.spans], validate=True)
    ((tags, root, children),) = traces(tmp_path)
    assert tags["validate"] == "True" and [c.name for c in children] == [s.name for s in t.spans]
    assert children[1].span_type == "TOOL" and children[1].outputs["text"] == "635"
    # Each engine call's input is the context it continued: the prompt and the trajectory so far.
    assert children[2].inputs["prompt_ids"] == tok.encode("A") + t.tokens[:t.spans[2].tokens[0]]
    assert root.outputs["response_text"] == tok.decode(t.tokens)


def test_no_tracer_without_a_backend_and_one_per_tensor_parallel_group(tmp_path, smol_tokenizer):
    class Engine:
        dp_rank, is_output_rank = 0, False

    assert rollout_tracer(trace_cfg(tmp_path, backend=None), smol_tokenizer, Engine()) is None
    assert rollout_tracer(trace_cfg(tmp_path), smol_tokenizer, Engine()) is None  # another rank of its group traces
    Engine.is_output_rank = True
    assert isinstance(rollout_tracer(trace_cfg(tmp_path), smol_tokenizer, Engine()), RolloutTracer)


@pytest.mark.parametrize("overrides, fragment", [
    (["actor_rollout_ref.rollout.trace.backend=weave"], "weave is not supported yet (rollout traces go to MLflow"),
    (["actor_rollout_ref.rollout.trace.backend=mlflow", "actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker=0"],
     "must be a whole number >= 1"),
])
def test_bad_trace_settings_stop_the_run_at_start(overrides, fragment):
    from hybrid_rl.config import ConfigError, validate_config
    from hybrid_rl.config_keys import compose_config

    with pytest.raises(ConfigError, match=re.escape(fragment)):
        validate_config(compose_config(overrides))


@pytest.mark.slow
def test_a_training_step_traces_its_chosen_prompts_beside_the_mlflow_metrics(ray_session, tmp_path):
    """The default job's rollout, one step through the driver with verl's trace keys: each
    worker's two chosen prompts with both their responses, in the store the mlflow logger fills."""
    from tests.test_multi_turn import train_through_driver

    run = tmp_path / "run"
    (step,) = train_through_driver([
        "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "data.max_response_length=24", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.total_training_steps=1",
        "actor_rollout_ref.actor.use_kl_loss=false", f"trainer.default_local_dir={run}", "trainer.logger=[jsonl,mlflow]",
        "trainer.project_name=proj", "trainer.experiment_name=exp", "trainer.progress_bar=false",
        "trainer.final_model_dir=null", "actor_rollout_ref.rollout.trace.backend=mlflow",
        "actor_rollout_ref.rollout.trace.token2text=true",
        "actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker=2",
    ], run)
    written = traces(tmp_path)
    assert len(written) == 4 and {tags["rollout_n"] for tags, _, _ in written} == {"0", "1"}
    assert len({tags["sample_index"] for tags, _, _ in written}) == 2
    for tags, root, (generate,) in written:
        assert (tags["step"], tags["validate"], tags["experiment_name"]) == ("1", "False", "exp")
        assert "Calculate" in root.inputs["prompt_text"] and generate.outputs["token_ids"] == root.outputs["response_ids"]
        assert 0 < len(generate.outputs["log_probs"]) <= 24
    import mlflow

    (run_info,) = mlflow.search_runs(experiment_names=["proj"], output_format="list")
    assert run_info.data.metrics["critic/score/mean"] == step["critic/score/mean"]  # the logger's run, same store
