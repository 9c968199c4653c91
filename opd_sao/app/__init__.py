"""The application layer, on top of everything else: the `opd-sao` command line (cli.py) and the pipeline that
runs a config's stages in order (pipeline.py). Nothing below imports it (tests/test_layout.py)."""
