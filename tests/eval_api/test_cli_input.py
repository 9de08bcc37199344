"""Bad input to the client verbs is one line on stderr and exit 2 (docs/cli.md), never a traceback."""

from __future__ import annotations

import pytest

from services.cli import main


@pytest.mark.parametrize("url", ["http://[::1", "http://host:port", "ftp://host", "no-scheme"])
def test_a_malformed_api_url_is_one_line_and_exit_2(url, capsys):
    code = main(["eval", "submit", "--api-url", url, "--policy", "1", "--suite", "metaworld-mt10",
                 "--episodes-per-task", "1"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and repr(url) in err and "--api-url" in err
    assert "Traceback" not in err
