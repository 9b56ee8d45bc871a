"""verl 0.9's on-policy distillation (`distillation.*`): the per-token losses against independent
float64 computations, the config's refusals, the routing of rows to teachers, and training steps
whose logged distillation loss is computed again here from the step's own responses and both
models' weights."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hybrid_rl.algorithms.distillation import forward_kl_top_k, sampled_token_losses
from hybrid_rl.config import ConfigError, Teacher, check_model_limits, distillation_teachers, validate_config
from hybrid_rl.config_keys import compose_config
from hybrid_rl.main import check_teacher_vocabulary
from hybrid_rl.models import load_tokenizer
from hybrid_rl.protocol import Batch
from hybrid_rl.trainer import teacher_rows

ON = ["distillation.enabled=true", "distillation.teacher_models.teacher_model.model_path=/teacher"]
LOSS = "distillation.distillation_loss"


def reference_forward_kl(student_logits, teacher_logits, k, clamp=None):
    """Per position, in float64 with plain loops: the teacher's top k, Σ p_T (log p_T − log p_S)
    over them (log-probs floored at `clamp`), floored at 0; and both masses."""
    losses, student_mass, teacher_mass = [], [], []
    for s_row, t_row in zip(student_logits.double().flatten(0, 1), teacher_logits.double().flatten(0, 1)):
        log_s = s_row - torch.logsumexp(s_row, 0)
        log_t = t_row - torch.logsumexp(t_row, 0)
        top = sorted(range(len(t_row)), key=lambda i: -float(log_t[i]))[:k]
        total = 0.0
        for i in top:
            lt, ls = float(log_t[i]), float(log_s[i])
            if clamp is not None:
                lt, ls = max(lt, clamp), max(ls, clamp)
            total += math.exp(lt) * (lt - ls)
        losses.append(max(total, 0.0))
        student_mass.append(sum(math.exp(float(log_s[i])) for i in top))
        teacher_mass.append(sum(math.exp(float(log_t[i])) for i in top))
    shape = student_logits.shape[:2]
    return [torch.tensor(v, dtype=torch.float64).view(shape) for v in (losses, student_mass, teacher_mass)]


@pytest.mark.parametrize("clamp", [None, -3.0])
def test_forward_kl_over_the_teachers_top_k(clamp):
    torch.manual_seed(0)
    student, teacher = torch.randn(3, 5, 40) * 2, torch.randn(3, 5, 40) * 2
    top = torch.log_softmax(teacher, -1).topk(6, dim=-1)
    out = forward_kl_top_k(student, top.values, top.indices, clamp)
    losses, student_mass, teacher_mass = reference_forward_kl(student, teacher, 6, clamp)
    torch.testing.assert_close(out.losses.double(), losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.student_mass.double(), student_mass, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.teacher_mass.double(), teacher_mass, rtol=1e-5, atol=1e-6)
    # The student's own distribution as the teacher: no loss, and its top k is the teacher's.
    same = torch.log_softmax(student, -1).topk(6, dim=-1)
    own = forward_kl_top_k(student, same.values, same.indices)
    assert float(own.losses.abs().max()) < 1e-5
    assert bool((own.overlap_count == 6).all())


def test_the_top_k_loss_has_the_forward_kl_gradient():
    """d/dz of Σ_i p_T(i)(log p_T(i) − log p_S(i)) is p_S(z)·m_T − p_T restricted to the top k
    (m_T the teacher's mass there), away from the floor at 0."""
    torch.manual_seed(1)
    student = torch.randn(1, 1, 12, requires_grad=True)
    teacher = torch.randn(1, 1, 12) * 3
    top = torch.log_softmax(teacher, -1).topk(4, dim=-1)
    forward_kl_top_k(student, top.values, top.indices).losses.sum().backward()
    p_s = torch.softmax(student.detach(), -1)[0, 0].double()
    p_t = torch.zeros(12, dtype=torch.float64)
    p_t[top.indices[0, 0]] = top.values[0, 0].double().exp()
    torch.testing.assert_close(student.grad[0, 0].double(), p_s * p_t.sum() - p_t, rtol=1e-5, atol=1e-6)


def test_sampled_token_losses_are_the_kl_estimators():
    student = torch.tensor([[-1.0, -2.5, -0.1]])
    teacher = torch.tensor([[-1.5, -2.0, -0.1]])
    d = student - teacher
    torch.testing.assert_close(sampled_token_losses(student, teacher, "k1"), d)
    torch.testing.assert_close(sampled_token_losses(student, teacher, "abs"), d.abs())
    torch.testing.assert_close(sampled_token_losses(student, teacher, "mse"), 0.5 * d * d)
    torch.testing.assert_close(sampled_token_losses(student, teacher, "low_var_kl"), torch.exp(-d) + d - 1)
    with pytest.raises(ValueError, match="not a sampled-token distillation loss"):
        sampled_token_losses(student, teacher, "full")


def test_teachers_from_verls_keys():
    assert distillation_teachers(compose_config([])) is None
    assert distillation_teachers(compose_config(ON)) == [
        Teacher("default", "distillation.teacher_models.teacher_model.model_path", "/teacher")]
    two = compose_config(["distillation.enabled=true", *(f"+distillation.teacher_models.{name}.{key}={value}"
                                                         for name, source in (("t1", "gsm8k"), ("t2", "math"))
                                                         for key, value in (("key", source),
                                                                            ("model_path", f"/{name}")))])
    assert [(t.key, t.path) for t in distillation_teachers(two)] == [("gsm8k", "/t1"), ("math", "/t2")]


@pytest.mark.parametrize("overrides, fragment", [
    (["distillation.enabled=true"], "teacher_model.model_path=None: set it to the teacher's model folder"),
    ([*ON, f"{LOSS}.loss_mode=reverse_kl"], "loss_mode='reverse_kl' is not valid"),
    ([*ON, f"{LOSS}.loss_mode=k1"], "the gradient of k1 itself does not depend on the teacher"),
    ([*ON, f"{LOSS}.use_policy_gradient=true", f"{LOSS}.policy_loss_mode=gspo"], "policy_loss_mode='gspo'"),
    ([*ON, f"{LOSS}.loss_mode=forward_kl_topk", f"{LOSS}.topk=0"], "topk=0 must be a whole number >= 1"),
    ([*ON, f"{LOSS}.loss_max_clamp=0"], "loss_max_clamp=0 must be a number > 0"),
    ([*ON, "+distillation.teacher_models.t2.model_path=/t2", "+distillation.teacher_models.t2.key=b"],
     "teacher_model is set beside other teachers"),
    (["distillation.enabled=true", "+distillation.teacher_models.t1.model_path=/t1",
      "+distillation.teacher_models.t2.model_path=/t2", "+distillation.teacher_models.t2.key=b"],
     "t1.key=None: with several teachers each needs"),
    ([*ON, "+distillation.teacher_models.teacher_model.modelpath=/m"],
     "teacher_model.modelpath is not a teacher setting; a teacher has inference, key, model_path"),
    (["distillation.enabled=true", *(f"+distillation.teacher_models.{n}.{k}={v}" for n in ("t1", "t2")
                                     for k, v in (("key", "same"), ("model_path", "/m")))], "another teacher's key"),
])
def test_bad_distillation_settings_are_refused(overrides, fragment):
    with pytest.raises(ConfigError) as error:
        validate_config(compose_config(overrides))
    assert fragment in str(error.value)


def test_a_megatron_student_takes_the_sampled_token_losses_only():
    validate_config(compose_config(ON, config_name="ppo_megatron_trainer"))
    cfg = compose_config([*ON, f"{LOSS}.loss_mode=forward_kl_topk"], config_name="ppo_megatron_trainer")
    with pytest.raises(ConfigError, match="logits, which the Megatron engine does not return"):
        validate_config(cfg)


def test_rows_go_to_the_teacher_of_their_key():
    teachers = [Teacher("gsm8k", "k", "/a"), Teacher("math", "k", "/b")]
    batch = Batch({"x": torch.zeros(3, 1)}, {"data_source": ["math", "gsm8k", "math"],
                                            "extra_info": [{"task": "b"}, {"task": "a"}, {"task": "b"}]})
    assert teacher_rows(batch, teachers, "data_source").tolist() == [1, 0, 1]
    assert teacher_rows(batch, teachers[:1], "data_source").tolist() == [0, 0, 0]  # one teacher: every row
    by_task = [Teacher("a", "k", "/a"), Teacher("b", "k", "/b")]
    assert teacher_rows(batch, by_task, "task").tolist() == [1, 0, 1]  # an extra_info entry
    with pytest.raises(ValueError, match=r"rows with data_source 'gsm8k' have no teacher"):
        teacher_rows(batch, teachers[1:] + [Teacher("code", "k", "/c")], "data_source")


def test_the_teacher_must_read_the_actors_token_ids(tiny_model_dir, tmp_path):
    from tests.test_reference_model import llama

    cfg = compose_config([*ON, f"actor_rollout_ref.model.path={tiny_model_dir}"])
    tokenizer = load_tokenizer(cfg, tiny_model_dir)
    padded = llama(tmp_path / "padded", tokenizer, len(tokenizer) + 8)
    check_teacher_vocabulary(cfg, tokenizer, tiny_model_dir, padded, "t")  # k3 reads the sampled ids only
    top_k = compose_config([*ON, f"{LOSS}.loss_mode=forward_kl_topk"])
    with pytest.raises(ConfigError, match="loss_mode=forward_kl_topk compares whole next-token distributions"):
        check_teacher_vocabulary(top_k, tokenizer, tiny_model_dir, padded, "t")
    short = llama(tmp_path / "short_context", tokenizer, len(tokenizer), max_positions=64)
    cfg = validate_config(compose_config([*ON, f"actor_rollout_ref.model.path={tiny_model_dir}",
                                          "data.max_prompt_length=48", "data.max_response_length=32"]))
    with pytest.raises(ConfigError, match=r"exceeds the distillation teacher's \(t\) context window \(64 tokens"):
        check_model_limits(cfg, tiny_model_dir, None, None, [("t", short)])


def logits_of(model_dir: str, tensors: dict) -> torch.Tensor:
    """Float32 logits (B, T, V) that predict each response token under the model in `model_dir`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"],
                       position_ids=tensors["position_ids"]).logits.float()
    return logits[:, -tensors["responses"].shape[1] - 1:-1]


def sampled(logits: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)


# A Megatron student over two ranks (PP=2) beside its FSDP teacher, sharded over both.
MEGATRON = ["trainer.n_gpus_per_node=2", "trainer.cpus_per_worker=1",
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
            "actor_rollout_ref.actor.megatron.dtype=fp32", "actor_rollout_ref.rollout.name=vllm"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["k3", "forward_kl_topk", "k1_policy_gradient", "k3_megatron"])
def test_a_step_distils_from_the_teacher(ray_session, tiny_model_dir, tiny_tokenizer, arithmetic_files, tmp_path,
                                         mode):
    """One step with a teacher of other weights. Its logged distillation loss is computed again
    from the dumped responses: k3 or the top-8 forward KL between the student's starting weights
    and the teacher, token mean; as a reward (k1, policy gradient, on policy: ratio 1) the PPO loss
    with advantage −k1 is the mean k1."""
    import json
    import os

    from hybrid_rl.main import build_trainer
    from tests.conftest import build_tiny_model, run_overrides
    from tests.test_algorithm_catalogue_runs import ONE_STEP

    teacher = build_tiny_model(tmp_path / "teacher", tiny_tokenizer, seed=1)
    out, dump = tmp_path / "run", tmp_path / "dump"
    settings = {"k3": ["loss_mode=k3", "use_task_rewards=false"],
                "forward_kl_topk": ["loss_mode=forward_kl_topk", "topk=8", "use_task_rewards=false"],
                "k1_policy_gradient": ["loss_mode=k1", "use_policy_gradient=true", "use_task_rewards=true"],
                "k3_megatron": ["loss_mode=k3", "use_task_rewards=false"]}[mode]
    overrides = run_overrides(tiny_model_dir, arithmetic_files, out, response=12) + [
        *ONE_STEP, "distillation.enabled=true", f"distillation.teacher_models.teacher_model.model_path={teacher}",
        *(f"{LOSS}.{item}" for item in settings), *(MEGATRON if mode.endswith("megatron") else []),
        "skip.rollout.enable=true", "skip.rollout.steps=[1]", f"skip.rollout.dump_dir={dump}"]
    trainer = build_trainer(compose_config(overrides, config_name="ppo_megatron_trainer" if mode.endswith("megatron")
                                           else "ppo_trainer"))
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    (metrics,) = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]

    (dumped,) = dump.glob("*/*/1/generation_0.pt")
    tensors = torch.load(dumped, weights_only=False)["generated"]["tensors"]
    mask = tensors["response_mask"].bool()
    student_logits, teacher_logits = logits_of(tiny_model_dir, tensors), logits_of(teacher, tensors)
    d = sampled(student_logits, tensors["responses"]) - sampled(teacher_logits, tensors["responses"])
    if mode == "forward_kl_topk":
        losses, student_mass, teacher_mass = reference_forward_kl(student_logits, teacher_logits, 8)
        assert metrics["distillation/student_mass"] == pytest.approx(float(student_mass[mask].mean()), rel=1e-4)
        assert metrics["distillation/teacher_mass"] == pytest.approx(float(teacher_mass[mask].mean()), rel=1e-4)
    else:
        losses = (torch.exp(-d) + d - 1) if mode.startswith("k3") else d
    expected = float(losses[mask].mean())
    assert abs(expected) > 1e-3  # the two models differ: the student's own weights give 0
    assert metrics["distillation/loss"] == pytest.approx(expected, rel=1e-4)
    assert metrics["distillation/loss_max"] == pytest.approx(float(losses[mask].max()), rel=1e-4)
    if mode == "k1_policy_gradient":  # the task's loss is there too
        assert "actor/pg_loss" in metrics and metrics["distillation/pg_clipfrac"] == 0.0
    assert np.isfinite(metrics["actor/grad_norm"])


@pytest.mark.slow
def test_each_row_is_scored_by_its_own_teacher(ray_session, tiny_model_dir, tiny_tokenizer, arithmetic_files,
                                               tmp_path):
    """Two teachers routed by an extra_info entry (the arithmetic rows' op): subtractions go to a
    model of other weights, additions to the student's own, which adds nothing to the loss; the
    logged k3 is the first teacher's over the subtraction rows' tokens only."""
    from tests.conftest import build_tiny_model, run_overrides
    from tests.test_algorithm_catalogue_runs import ONE_STEP, train

    teacher = build_tiny_model(tmp_path / "teacher", tiny_tokenizer, seed=1)
    out, dump = tmp_path / "run", tmp_path / "dump"
    overrides = run_overrides(tiny_model_dir, arithmetic_files, out, response=12) + [
        *ONE_STEP, "distillation.enabled=true", "distillation.teacher_key=op", f"{LOSS}.use_task_rewards=false",
        "+distillation.teacher_models.minus.key=-", f"+distillation.teacher_models.minus.model_path={teacher}",
        "+distillation.teacher_models.plus.key=+", f"+distillation.teacher_models.plus.model_path={tiny_model_dir}",
        "skip.rollout.enable=true", "skip.rollout.steps=[1]", f"skip.rollout.dump_dir={dump}"]
    (metrics,) = train(overrides, out)

    (dumped,) = dump.glob("*/*/1/generation_0.pt")
    saved = torch.load(dumped, weights_only=False)["generated"]
    tensors = saved["tensors"]
    minus = torch.tensor([info["op"] == "-" for info in saved["non_tensors"]["extra_info"]])
    assert 0 < int(minus.sum()) < len(minus)  # both teachers have rows
    mask = tensors["response_mask"].bool()
    d = sampled(logits_of(tiny_model_dir, tensors), tensors["responses"]) - sampled(logits_of(teacher, tensors),
                                                                                     tensors["responses"])
    k3 = (torch.exp(-d) + d - 1) * minus.unsqueeze(-1)
    assert metrics["distillation/loss"] == pytest.approx(float(k3[mask].mean()), rel=1e-4)
