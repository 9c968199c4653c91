"""tests/sglang_worker.py with each decode step slowed by DELAY_S seconds first: generations as long as real
ones (seconds, not milliseconds), for tests that need requests in flight while a weight sync runs.

Usage: python tests/slow_sglang_worker.py DELAY_S CHECKPOINT --port PORT [sglang_worker.py options]
"""
from __future__ import annotations

import runpy
import sys
import time
from pathlib import Path

from opd_sao.engines.embedded import EmbeddedEngine

if __name__ == "__main__":
    delay_s, step = float(sys.argv.pop(1)), EmbeddedEngine._decode_step

    def slowed(self, active):
        time.sleep(delay_s)
        return step(self, active)

    EmbeddedEngine._decode_step = slowed
    runpy.run_path(str(Path(__file__).resolve().parent / "sglang_worker.py"), run_name="__main__")
