"""What surrounds a training run: the loop's steps (run), the run folder and its checkpoints (run_folder),
processes and stop signals (processes), the step's metrics (metrics) and the figures (plots).

The run layer, beside the root's eval.py: it imports the plain layer and the fast paths, never train.py,
merge.py or the study.
"""
