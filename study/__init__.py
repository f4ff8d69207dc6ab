"""The study that experiments.py runs, in rooms called one way: the flags, parsed once (flags), the runs
(runs), which runs each part trains (parts), the plan of their time (plan), the tables and the report
(tables); beneath them the worker processes (workers) and the statistics (stats), which import no room.

The top layer, beside experiments.py: it may import every layer below and train.py; a room imports only the
rooms before it (tests/test_structure.py pins the order: stats, workers, flags, runs, parts, plan, tables).
"""
