"""A run's file and output primitives, the layer under the trainer, engines, RL and stages: crash-safe writes and
containment (files.py), the run-directory lock, metrics lines (tracking.py), the resume records (fingerprints of
config, data and base model), seconds per phase (timing.py) and progress lines. Nothing here imports more of ours
than the error base and regular_files, so any layer may use it (tests/test_layout.py)."""
