"""A Ctrl-C before a command handles its own stop signals (torch or Orbax still being imported) ends
``chunkzero`` with one line and exit 130, not a ``KeyboardInterrupt`` traceback."""

from __future__ import annotations

import chunkzero.cli as cli


def test_ctrl_c_before_a_command_handles_it_is_one_line_and_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_inspect", interrupted)
    assert cli.main(["inspect", "some-checkpoint"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["chunkzero inspect: stopped by SIGINT (Ctrl-C)"]
