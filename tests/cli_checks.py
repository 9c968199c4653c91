"""The one-line-error promise of the CLI, checked the same way by every hostile-input test."""
from __future__ import annotations

from opd_sao.app import cli


def refused(capsys, *argv) -> str:
    """Run the CLI in this process: it must return 2 (not raise) and print exactly one line; that line."""
    assert cli.main(list(argv)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"opd-sao {argv[0]}: error: "), err
    return err[0]
