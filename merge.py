"""Write a LoRA checkpoint (train.py --lora-rank) as one model: its adapters merged into its base, a
transformers folder in float32 that any library loads, peft or not.

    python merge.py runs/default/grpo/checkpoint merged   # then: merged/model, or --model merged here

The folder is written by the rule of written.py: <out> holds a record, and an earlier merge there is replaced
only once the new one is whole; anything else in <out> is left as it is.
"""

import sys
from pathlib import Path

import torch
import transformers

from lora import ADAPTER_CONFIG, adapter_folder, base_of, merged
from model import load_model
from processes import bad_input_is_one_line
from written import NotWritten, owned


def main(argv: list[str] | None = None) -> Path:
    """<checkpoint> <out>: the checkpoint's adapters merged into its base, in <out>/model; returns that path.
    A bad path, a damaged checkpoint or an <out> that is not merge.py's is one line."""
    if len(argv := sys.argv[1:] if argv is None else argv) != 2:
        sys.exit("usage: python merge.py <checkpoint of a train.py --lora-rank run> <out folder>")
    checkpoint, out = argv
    if not (adapters := adapter_folder(checkpoint)):
        sys.exit(f"error: {checkpoint} holds no LoRA adapters ({ADAPTER_CONFIG}): nothing to merge")
    transformers.logging.disable_progress_bar()  # no bar for writing one file
    with bad_input_is_one_line():
        model, tokenizer = load_model(checkpoint, torch.device("cpu"))
        try:
            with owned(Path(out), "merged") as folder:
                with folder.filling("model.new") as new:
                    merged(model).save_pretrained(new)
                    tokenizer.save_pretrained(new)
                folder.remove("model")  # an earlier merge, once the new one is whole
                folder.rename("model.new", "model")
        except NotWritten as e:
            sys.exit(f"error: {e}")
    print(f"{out}/model: {base_of(adapters)} with the adapters of {checkpoint} merged in")
    return Path(out) / "model"


if __name__ == "__main__":
    main()
