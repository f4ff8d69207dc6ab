"""What the model and a run stand on: files and their ownership record (written, records), the model files
and LoRA adapters (model_files, lora), the device and its memory (hardware, memory), and flag parsing (flags).

The plain layer, beside the root's advantage.py, model.py and verifier.py and data/: it imports only them and
itself, never the fast paths, the loop, the scripts or the study.
"""
