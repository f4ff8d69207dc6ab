"""The study that experiments.py runs, in rooms it calls in one direction: its flags (flags), the runs it
trains (runs), the workers that train them (workers), the plan of their time (plan), the tables and the
report (tables), with the statistics (stats) beneath them all.

The top layer, beside experiments.py: it may import any layer below it and train.py; a room imports only the
rooms before it (tests/test_structure.py pins their order).
"""
