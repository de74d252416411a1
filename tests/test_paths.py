"""pbs_toolkit/paths.py answers the plain XDG case itself (so `pbstk logs -n` does not import platformdirs): its
directories must be exactly platformdirs' in every case, the ones it answers and the ones it hands over."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import platformdirs
import pytest

from pbs_toolkit import paths

DIRS = [(paths.user_config_dir, platformdirs.user_config_dir, "XDG_CONFIG_HOME"),
        (paths.user_state_dir, platformdirs.user_state_dir, "XDG_STATE_HOME"),
        (paths.user_data_dir, platformdirs.user_data_dir, "XDG_DATA_HOME")]


@pytest.mark.parametrize(
    ("value", "home"),
    [
        ("{tmp}/xdg", "{tmp}/home"),  # the variable, absolute
        ("{tmp}/xdg/", "{tmp}/home"),  # with a trailing slash
        ("//{tmp}/xdg", "{tmp}/home"),  # two leading slashes (POSIX keeps them)
        (None, "{tmp}/home"),  # unset: under HOME
        (None, "{tmp}/home/"),
        (None, "/"),
        ("", "{tmp}/home"),  # empty counts as unset
        ("relative/xdg", "{tmp}/home"),  # not absolute: platformdirs decides
        (None, "relative-home"),  # a relative HOME: platformdirs decides
        (None, None),  # no HOME at all
    ],
)
def test_the_plain_case_is_platformdirs_answer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str | None,
                                               home: str | None) -> None:
    for ours, theirs, variable in DIRS:
        with monkeypatch.context() as env:
            for name, setting in ((variable, value), ("HOME", home)):
                if setting is None:
                    env.delenv(name, raising=False)
                else:
                    env.setenv(name, setting.format(tmp=tmp_path))
            assert ours() == Path(theirs("pbstk", appauthor=False)), (variable, value, home)


def test_the_plain_case_does_not_import_platformdirs(tmp_path: Path) -> None:
    code = ("import sys; from pbs_toolkit import paths; print(paths.user_state_dir(), paths.user_config_dir(), "
            "paths.user_data_dir()); print('platformdirs' in sys.modules)")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "XDG_STATE_HOME": f"{tmp_path}/state",
           "PYTHONPATH": str(Path(paths.__file__).parent.parent)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,  # noqa: S603
                         check=True).stdout.split("\n")
    assert out[0] == f"{tmp_path}/state/pbstk {tmp_path}/.config/pbstk {tmp_path}/.local/share/pbstk"
    assert out[1] == ("True" if sys.platform != "linux" else "False")
