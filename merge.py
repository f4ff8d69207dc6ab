"""Write a LoRA checkpoint (train.py --lora-rank) as one model: its adapters merged into its base, a
transformers folder in float32 that any library loads, peft or not.

    python merge.py runs/default/grpo/checkpoint merged   # then: merged/model, or --model merged here

The folder is written by the rule of infra/written.py: <out> holds a record, and an earlier merge there is
replaced only once the new one is whole; anything else in <out> is left as it is. A merge stopped at any
moment (a kill, a full disk) leaves the earlier merge or the new one, and what it left part-written goes at
the next.
"""

import sys
from pathlib import Path

import torch
import transformers
from safetensors import SafetensorError

from infra.lora import ADAPTER_CONFIG, adapter_folder, base_of, merged
from infra.model_files import settled
from infra.written import NotWritten, owned
from loop.processes import bad_input_is_one_line
from model import load_model


def write_merged(out: Path, model, tokenizer) -> Path:
    """`model` with its adapters merged in, and `tokenizer`, as <out>/model; returns that path. A merge there
    stopped part-way is cleared first: its recorded temporaries, and model.new, filled but not yet renamed
    into place. An <out> that is not merge.py's, or a failed write (a full disk), is one line."""
    try:
        with owned(out, "merged") as folder:
            folder.remove_temporaries()
            folder.remove("model.new")
            with folder.filling("model.new") as new:
                merged(model).save_pretrained(new)
                tokenizer.save_pretrained(new)
            folder.remove("model")  # an earlier merge, once the new one is whole
            return folder.rename("model.new", "model")
    except NotWritten as e:
        sys.exit(f"error: {e}")
    except (OSError, SafetensorError) as e:  # a full disk: safetensors' error is not an OSError
        reason = getattr(e, "strerror", None) or str(e).splitlines()[0]
        sys.exit(f"error: the merge could not be written in {out} ({reason}): run merge.py again once there "
                 "is room")


def main(argv: list[str] | None = None) -> Path:
    """<checkpoint> <out>: the checkpoint's adapters merged into its base, in <out>/model; returns that path.
    A bad path, a damaged checkpoint, adapters of another base or an <out> that is not merge.py's is one
    line."""
    if len(argv := sys.argv[1:] if argv is None else argv) != 2:
        sys.exit("usage: python merge.py <checkpoint of a train.py --lora-rank run> <out folder>")
    checkpoint, out = argv
    with bad_input_is_one_line():  # a run saving it: its new one, or a line naming checkpoint.old, as eval.py
        settled(Path(checkpoint))
    if not (adapters := adapter_folder(checkpoint)):
        sys.exit(f"error: {checkpoint} holds no LoRA adapters ({ADAPTER_CONFIG}): nothing to merge")
    transformers.logging.disable_progress_bar()  # no bar for writing one file
    with bad_input_is_one_line():
        model, tokenizer = load_model(checkpoint, torch.device("cpu"))
    written = write_merged(Path(out), model, tokenizer)
    print(f"{written}: {base_of(adapters)} with the adapters of {checkpoint} merged in")
    return written


if __name__ == "__main__":
    main()
