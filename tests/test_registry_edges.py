"""Registry files as users really write them (issue 21, item 20): ``ENDPOINTS`` assigned inside ``try``/``if``,
a byte order mark, a comment inside an empty ``ENDPOINTS``.

Each edited ``endpoints.py`` is then run by Python itself: what counts is the dict that Python ends up with.
"""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

from pbs_toolkit.endpoints.registry import EndpointEntry, read_endpoints, remove_endpoint, write_endpoint
from pbs_toolkit.errors import RegistryError

MINE = '"mine": {"model": "org/a", "url": "http://a:1/v1", "key": "A_KEY"}'
NEW = EndpointEntry(alias="qwen", model="Qwen/Qwen3-VL-2B-Instruct", url="http://gpu01:8000/v1",
                    key_env="PBSTK_KEY_QWEN")


def endpoints_python_keeps(path: Path) -> dict:
    """The ``ENDPOINTS`` that running the file gives (``private_endpoints`` does not exist here)."""
    return dict(runpy.run_path(str(path))["ENDPOINTS"])


TRY_EXCEPT = f'''"""Endpoints: a private file wins where it exists."""

try:
    from private_endpoints import ENDPOINTS  # noqa: F401
except ImportError:
    ENDPOINTS = {{
        {MINE},
    }}
'''

IF_ONLY = f'''import os

if os.environ.get("NO_SUCH_VARIABLE_PBSTK") is None:
    ENDPOINTS = {{{MINE}}}
'''


@pytest.mark.parametrize("source", [TRY_EXCEPT, IF_ONLY], ids=["try-except", "if"])
def test_endpoints_inside_a_block_is_edited_where_it_is(tmp_path: Path, source: str) -> None:
    path = tmp_path / "endpoints.py"
    path.write_text(source)
    write_endpoint(path, NEW)
    text = path.read_text()
    assert text.count("ENDPOINTS =") == 1, text  # was: a second ENDPOINTS appended, hiding "mine"
    assert set(endpoints_python_keeps(path)) == {"mine", "qwen"}
    assert set(read_endpoints(path)) == {"mine", "qwen"}
    assert remove_endpoint(path, "qwen") is True  # what cancel does
    assert path.read_text() == source  # was: "ENDPOINTS = {}" left at the end, hiding "mine" for good
    assert set(endpoints_python_keeps(path)) == {"mine"}


def test_the_new_entry_is_indented_under_its_block(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.py"
    path.write_text("try:\n    from private_endpoints import ENDPOINTS\nexcept ImportError:\n    ENDPOINTS = {}\n")
    write_endpoint(path, NEW)
    assert path.read_text() == (
        "try:\n    from private_endpoints import ENDPOINTS\nexcept ImportError:\n    ENDPOINTS = {\n"
        '        "qwen": {\n'
        '            "model": "Qwen/Qwen3-VL-2B-Instruct",\n'
        '            "url": "http://gpu01:8000/v1",\n'
        '            "key": "PBSTK_KEY_QWEN",\n'
        "        },\n"
        "    }\n")
    assert set(endpoints_python_keeps(path)) == {"qwen"}
    remove_endpoint(path, "qwen")
    assert path.read_text().endswith("    ENDPOINTS = {}\n")


def test_two_dicts_that_python_may_each_keep_are_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.py"
    source = f'import os\n\nif os.environ.get("X"):\n    ENDPOINTS = {{{MINE}}}\nelse:\n    ENDPOINTS = {{}}\n'
    path.write_text(source)
    with pytest.raises(RegistryError, match=r"ENDPOINTS is assigned a dict on lines 4, 6 .* will not guess"):
        write_endpoint(path, NEW)
    assert path.read_text() == source


def test_a_later_top_level_assignment_still_wins(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.py"
    source = f"try:\n    ENDPOINTS = {{{MINE}}}\nexcept Exception:\n    pass\n\nENDPOINTS = {{}}\n"
    path.write_text(source)
    write_endpoint(path, NEW)
    assert set(endpoints_python_keeps(path)) == {"qwen"}  # the last top-level dict is the one Python keeps


def test_an_imported_endpoints_is_refused_not_hidden(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.py"
    source = "from private_endpoints import ENDPOINTS  # noqa: F401\n"
    path.write_text(source)
    with pytest.raises(RegistryError, match=r"line 1: ENDPOINTS is not a dict literal"):
        write_endpoint(path, NEW)
    assert path.read_text() == source


# -- a byte order mark -------------------------------------------------------------------------------------------

BOM_SOURCES = {
    "py": f"ENDPOINTS = {{\n    {MINE},\n}}\n",
    "toml": '[[endpoint]]\nendpoint_id = "mine"\nmodel = "org/a"\nurl = "http://a:1/v1"\nkey = "A_KEY"\n',
    "yaml": "endpoints:\n  mine:\n    model: org/a\n    url: http://a:1/v1\n    key_env: A_KEY\n",
    "json": json.dumps({"endpoints": {"mine": {"model": "org/a", "url": "http://a:1/v1", "key_env": "A_KEY"}}}),
}


@pytest.mark.parametrize("fmt", sorted(BOM_SOURCES))
def test_a_file_with_a_byte_order_mark_is_read_edited_and_keeps_it(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / f"endpoints.{fmt}"
    path.write_bytes(b"\xef\xbb\xbf" + BOM_SOURCES[fmt].encode())
    assert set(read_endpoints(path)) == {"mine"}  # was: "invalid non-printable character U+FEFF" and the like
    write_endpoint(path, NEW)
    data = path.read_bytes()
    assert data.startswith(b"\xef\xbb\xbf") and not data[3:].startswith(b"\xef\xbb\xbf")
    assert set(read_endpoints(path)) == {"mine", "qwen"}
    remove_endpoint(path, "qwen")
    assert set(read_endpoints(path)) == {"mine"} and path.read_bytes().startswith(b"\xef\xbb\xbf")
    if fmt == "py":
        assert path.read_bytes() == b"\xef\xbb\xbf" + BOM_SOURCES[fmt].encode()
        assert set(endpoints_python_keeps(path)) == {"mine"}  # Python reads the mark as utf-8-sig


# -- a comment inside an empty ENDPOINTS -------------------------------------------------------------------------


@pytest.mark.parametrize("inside", ["    # add your endpoints here\n", "    # one\n\n    # two\n"])
def test_a_comment_inside_an_empty_endpoints_is_kept(tmp_path: Path, inside: str) -> None:
    path = tmp_path / "endpoints.py"
    source = f'"""Endpoints."""\n\nENDPOINTS = {{\n{inside}}}\n'
    path.write_text(source)
    write_endpoint(path, NEW)
    text = path.read_text()
    assert text.startswith(f'"""Endpoints."""\n\nENDPOINTS = {{\n{inside}    "qwen": {{\n'), text
    assert set(endpoints_python_keeps(path)) == {"qwen"}
    remove_endpoint(path, "qwen")
    assert path.read_text() == source  # the comment survives the entry's removal too


def test_an_empty_dict_round_trips_to_itself(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.py"
    path.write_text("ENDPOINTS = {}\n")
    write_endpoint(path, NEW)
    remove_endpoint(path, "qwen")
    assert path.read_text() == "ENDPOINTS = {}\n"
