"""Run-level code over the trainer, engines and RL loop, used by the stages and the pipeline: held-out evaluation,
a stage's resumable state (checkpointing.py) and report.md. File primitives live below, in opd_sao/io/."""
