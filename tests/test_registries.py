"""Endpoint registries: each format keeps what it does not own, writes atomically, survives concurrency."""

from __future__ import annotations

import multiprocessing
import os
import stat
from pathlib import Path

import pytest

from pbs_toolkit.endpoints.registry import (
    FORMATS,
    EndpointEntry,
    default_registry_path,
    detect_format,
    read_endpoints,
    remove_endpoint,
    write_endpoint,
)
from pbs_toolkit.errors import RegistryError

NEW = EndpointEntry(
    alias="qwen3-vl-2b", model="Qwen/Qwen3-VL-2B-Instruct", url="http://gpu01:8000/v1", key_env="VLLM_KEY"
)

PY_HEAD = '''"""Endpoints for my evaluations."""

import os  # unused, but ours

# OpenAI models first
ENDPOINTS = {
    # a comment inside the dict
    "gpt-4.1-mini": {"model": "gpt-4.1-mini", "url": "https://api.openai.com/v1", "key": "OPENAI_API_KEY"},
'''
PY_OLD = """    'local':   {
        "model": "old-model",  # keep me? no: this entry is replaced
        "url": "http://0.0.0.0:8000/v1",
        "key": "EMPTY_KEY",
    },"""
PY_TAIL = """  # after local
    # closing comment
}

OTHER = {"not": "touched"}
"""
PY_SOURCE = PY_HEAD + PY_OLD + PY_TAIL

TOML_HEAD = """# verifiers endpoints
title = "mine"

[[endpoint]]
endpoint_id = "gpt-4.1-mini"   # OpenAI
model = "gpt-4.1-mini"
url = "https://api.openai.com/v1"
key = "OPENAI_API_KEY"

"""
TOML_LOCAL = """[[endpoint]]
endpoint_id = "local"
model = "old-model"
url = "http://0.0.0.0:8000/v1"
key = "EMPTY_KEY"
extra = "kept"
"""
TOML_TAIL = """
# settings that are not endpoints
[defaults]
temperature = 0.0
"""
TOML_SOURCE = TOML_HEAD + TOML_LOCAL + TOML_TAIL


@pytest.fixture(autouse=True)
def user_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg-data"))
    return tmp_path


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# ---------------------------------------------------------------- py


def test_py_append_keeps_every_other_byte(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.py"
    path.write_text(PY_SOURCE)
    write_endpoint(path, NEW)
    text = path.read_text()
    before, after = text.split('    "qwen3-vl-2b": {', 1)
    assert before == PY_HEAD + PY_OLD + "  # after local\n"
    assert after.endswith('    # closing comment\n}\n\nOTHER = {"not": "touched"}\n')
    assert read_endpoints(path)["qwen3-vl-2b"] == NEW
    assert set(read_endpoints(path)) == {"gpt-4.1-mini", "local", "qwen3-vl-2b"}
    # removing it again gives back the user's file exactly
    assert remove_endpoint(path, NEW.alias) is True
    assert path.read_text() == PY_SOURCE


def test_py_replace_touches_only_that_value(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.py"
    path.write_text(PY_SOURCE)
    write_endpoint(path, EndpointEntry("local", "new-model", "http://gpu02:8001/v1", "VLLM_KEY"))
    text = path.read_text()
    assert text.startswith(PY_HEAD + "    'local':   {")
    assert text.endswith("}," + PY_TAIL)
    assert "old-model" not in text
    assert read_endpoints(path)["local"] == EndpointEntry(
        "local", "new-model", "http://gpu02:8001/v1", "VLLM_KEY"
    )
    assert text.count("'local'") == 1


def test_py_one_line_dict_stays_one_line(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.py"
    path.write_text('ENDPOINTS = {"a": {"model": "m", "url": "http://h:1/v1", "key": "K"}}\n')
    write_endpoint(path, NEW)
    assert path.read_text() == (
        'ENDPOINTS = {"a": {"model": "m", "url": "http://h:1/v1", "key": "K"}, "qwen3-vl-2b": '
        '{"model": "Qwen/Qwen3-VL-2B-Instruct", "url": "http://gpu01:8000/v1", "key": "VLLM_KEY"}}\n'
    )


def test_py_without_endpoints_gets_one_appended(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.py"
    path.write_text("# just a comment\nX = 1\n")
    write_endpoint(path, NEW)
    assert path.read_text().startswith("# just a comment\nX = 1\n\nENDPOINTS = {\n")
    assert read_endpoints(path) == {NEW.alias: NEW}


@pytest.mark.parametrize("value", ["load_endpoints()", "dict(a=1)", "[]"])
def test_py_endpoints_not_a_dict_literal_is_refused(tmp_path: Path, value: str) -> None:
    path = tmp_path / "endpoints.py"
    source = f"ENDPOINTS = {value}\n"
    path.write_text(source)
    with pytest.raises(RegistryError, match="not a dict literal"):
        write_endpoint(path, NEW)
    assert path.read_text() == source


def test_py_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.py"
    source = 'ENDPOINTS = {\n    "a": {"model": "m",,}\n}\n'
    path.write_text(source)
    with pytest.raises(RegistryError, match=r"endpoints\.py: cannot parse as Python: line 2") as info:
        write_endpoint(path, NEW)
    assert "\n" not in str(info.value)
    assert path.read_text() == source
    with pytest.raises(RegistryError, match="line 2"):
        read_endpoints(path)


# ---------------------------------------------------------------- toml


def test_toml_append_keeps_every_other_byte(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.toml"
    path.write_text(TOML_SOURCE)
    write_endpoint(path, NEW)
    new_table = (
        '[[endpoint]]\nendpoint_id = "qwen3-vl-2b"\nmodel = "Qwen/Qwen3-VL-2B-Instruct"\n'
        'url = "http://gpu01:8000/v1"\nkey = "VLLM_KEY"\n'
    )
    # the comment that introduces [defaults] stays right above it, below the new table
    assert path.read_text() == TOML_HEAD + TOML_LOCAL + "\n" + new_table + TOML_TAIL
    assert read_endpoints(path)[NEW.alias] == NEW
    assert remove_endpoint(path, NEW.alias) is True
    assert path.read_text() == TOML_SOURCE


def test_toml_replace_updates_table_in_place(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.toml"
    path.write_text(TOML_SOURCE)
    entry = EndpointEntry("local", "new-model", "http://gpu02:8001/v1", "VLLM_KEY")
    write_endpoint(path, entry)
    expected_table = TOML_LOCAL.replace("old-model", "new-model").replace("0.0.0.0:8000", "gpu02:8001")
    assert path.read_text() == TOML_HEAD + expected_table.replace("EMPTY_KEY", "VLLM_KEY") + TOML_TAIL
    assert read_endpoints(path)["local"] == entry


def test_toml_endpoint_not_tables_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.toml"
    path.write_text('endpoint = "nope"\n')
    with pytest.raises(RegistryError, match=r"endpoints\.toml: 'endpoint' is not an array"):
        write_endpoint(path, NEW)
    assert path.read_text() == 'endpoint = "nope"\n'


# ---------------------------------------------------------------- yaml / json


@pytest.mark.parametrize("fmt", ["yaml", "json"])
def test_own_format_keeps_other_keys(tmp_path: Path, fmt: str) -> None:
    import json

    import yaml

    path = tmp_path / f"endpoints.{fmt}"
    data = {
        "version": 1,
        "endpoints": {"old": {"model": "m", "url": "http://h:1/v1", "key_env": "K", "note": "mine"}},
    }
    path.write_text(json.dumps(data) if fmt == "json" else yaml.safe_dump(data))
    write_endpoint(path, NEW)
    write_endpoint(path, EndpointEntry("old", "m2", "http://h:2/v1", "K2"))
    loaded = json.loads(path.read_text()) if fmt == "json" else yaml.safe_load(path.read_text())
    assert loaded["version"] == 1
    assert loaded["endpoints"]["old"]["note"] == "mine"
    assert loaded["endpoints"]["old"]["model"] == "m2"
    assert loaded["endpoints"][NEW.alias]["key_env"] == "VLLM_KEY"
    assert "updated" in loaded["endpoints"][NEW.alias]
    assert read_endpoints(path) == {"old": EndpointEntry("old", "m2", "http://h:2/v1", "K2"), NEW.alias: NEW}


# ---------------------------------------------------------------- every format


@pytest.mark.parametrize("fmt", FORMATS)
def test_new_file_round_trip_and_replace(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / f"endpoints.{fmt}"
    assert read_endpoints(path) == {}
    assert write_endpoint(path, NEW) == path
    assert _mode(path) == 0o644
    assert read_endpoints(path) == {NEW.alias: NEW}
    other = EndpointEntry("other", "m", "https://example.org/v1", "OTHER_KEY")
    write_endpoint(path, other)
    moved = EndpointEntry(NEW.alias, NEW.model, "http://gpu09:8123/v1", NEW.key_env)
    write_endpoint(path, moved)
    assert read_endpoints(path) == {NEW.alias: moved, "other": other}
    assert remove_endpoint(path, "other") is True
    assert remove_endpoint(path, "other") is False
    assert read_endpoints(path) == {NEW.alias: moved}
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


UNPARSABLE = {
    "py": "ENDPOINTS = {\n",
    "toml": "[[endpoint]\nendpoint_id = 1\n",
    "yaml": "endpoints: {a: [\n",
    "json": '{"endpoints": {',
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_unparsable_file_is_left_byte_identical(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / f"endpoints.{fmt}"
    path.write_bytes(UNPARSABLE[fmt].encode())
    os.chmod(path, 0o640)
    with pytest.raises(RegistryError, match=rf"^{tmp_path}/endpoints\.{fmt}: cannot parse") as info:
        write_endpoint(path, NEW)
    assert "\n" not in str(info.value)
    assert path.read_bytes() == UNPARSABLE[fmt].encode()
    assert _mode(path) == 0o640
    with pytest.raises(RegistryError, match="cannot parse"):
        remove_endpoint(path, "a")
    with pytest.raises(RegistryError, match="cannot parse"):
        read_endpoints(path)
    assert path.read_bytes() == UNPARSABLE[fmt].encode()


@pytest.mark.parametrize("fmt", ["yaml", "json"])
def test_own_format_with_wrong_shape_is_refused(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / f"endpoints.{fmt}"
    source = "- a list\n" if fmt == "yaml" else "[1, 2]\n"
    path.write_text(source)
    with pytest.raises(RegistryError, match="cannot parse: expected a mapping"):
        write_endpoint(path, NEW)
    assert path.read_text() == source


@pytest.mark.parametrize("fmt", FORMATS)
def test_missing_directory_is_not_created(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / "no-such-dir" / f"endpoints.{fmt}"
    with pytest.raises(RegistryError, match=rf"^{tmp_path}/no-such-dir does not exist$"):
        write_endpoint(path, NEW)
    assert not path.parent.exists()


def test_default_registry_honours_xdg_and_creates_its_directory(user_dirs: Path) -> None:
    assert default_registry_path() == user_dirs / "xdg-data" / "pbstk" / "endpoints.yaml"
    assert write_endpoint(None, NEW) == default_registry_path()
    assert read_endpoints(None) == {NEW.alias: NEW}
    assert read_endpoints(default_registry_path()) == {NEW.alias: NEW}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    ("alias", "reason"),
    [
        ("", "non-empty"),
        ("a\nb", "control character"),
        ("a\x00b", "control character"),
        ("a\x1bb", "control character"),
        ("a\u2028b", "control character"),
        (" padded", "whitespace"),
    ],
)
def test_bad_alias_is_refused(tmp_path: Path, fmt: str, alias: str, reason: str) -> None:
    path = tmp_path / f"endpoints.{fmt}"
    with pytest.raises(RegistryError, match=reason):
        write_endpoint(path, EndpointEntry(alias, "m", "http://h:1/v1", "K"))
    assert not path.exists()


def test_py_refuses_unprintable_alias_others_accept_it(tmp_path: Path) -> None:
    alias = "nbsp\u00a0alias"  # a no-break space: fine in TOML/YAML/JSON keys, invisible in Python source
    with pytest.raises(RegistryError, match="not printable"):
        write_endpoint(tmp_path / "endpoints.py", EndpointEntry(alias, "m", "http://h:1/v1", "K"))
    for fmt in ("toml", "yaml", "json"):
        path = tmp_path / f"endpoints.{fmt}"
        write_endpoint(path, EndpointEntry(alias, "m", "http://h:1/v1", "K"))
        assert alias in read_endpoints(path)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quotes_and_unicode_in_values_round_trip(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / f"endpoints.{fmt}"
    entry = EndpointEntry("mod\"el's \\ é", 'org/"quoted" \\ model', "http://h:1/v1?a=b#c", "_K9")
    write_endpoint(path, entry)
    assert read_endpoints(path) == {entry.alias: entry}


@pytest.mark.parametrize(
    ("url", "key_env", "match"),
    [
        ("0.0.0.0:8000/v1", "K", "must start with http"),
        ("ftp://h/v1", "K", "must start with http"),
        ("http://h:1/v1 extra", "K", "no spaces"),
        ("http://h:1/v1", "9KEY", "must name an environment variable"),
        ("http://h:1/v1", "sk-abc123", "must name an environment variable"),
        ("http://h:1/v1", "", "must name an environment variable"),
    ],
)
def test_bad_url_or_key_env_is_refused(tmp_path: Path, url: str, key_env: str, match: str) -> None:
    with pytest.raises(RegistryError, match=match):
        write_endpoint(tmp_path / "endpoints.py", EndpointEntry("a", "m", url, key_env))


# ---------------------------------------------------------------- modes and secrets


@pytest.mark.parametrize("fmt", ["yaml", "json"])
def test_api_key_makes_the_file_0600(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / f"endpoints.{fmt}"
    write_endpoint(path, NEW, api_key="sk-secret")
    assert _mode(path) == 0o600
    assert "sk-secret" in path.read_text()
    # an existing world-readable registry loses group/other bits once it holds a key
    other = tmp_path / f"shared.{fmt}"
    write_endpoint(other, NEW)
    assert _mode(other) == 0o644
    write_endpoint(other, EndpointEntry("b", "m", "http://h:1/v1", "K"), api_key="sk-2")
    assert _mode(other) == 0o600


@pytest.mark.parametrize("fmt", ["py", "toml"])
def test_api_key_is_never_written_to_verifiers_formats(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / f"endpoints.{fmt}"
    with pytest.raises(RegistryError, match="never hold the key itself"):
        write_endpoint(path, NEW, api_key="sk-secret")
    assert not path.exists()


@pytest.mark.parametrize("fmt", FORMATS)
def test_existing_mode_is_kept(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / f"endpoints.{fmt}"
    write_endpoint(path, NEW)
    os.chmod(path, 0o640)
    write_endpoint(path, EndpointEntry("b", "m", "http://h:1/v1", "K"))
    assert _mode(path) == 0o640
    remove_endpoint(path, "b")
    assert _mode(path) == 0o640


def test_symlinked_registry_is_edited_through_the_link(tmp_path: Path) -> None:
    real = tmp_path / "real.toml"
    link = tmp_path / "endpoints.toml"
    link.symlink_to(real)
    write_endpoint(link, NEW)
    assert link.is_symlink()
    assert read_endpoints(real) == {NEW.alias: NEW}


def test_detect_format() -> None:
    assert detect_format("a/endpoints.py") == "py"
    assert detect_format("a/endpoints.TOML") == "toml"
    assert detect_format("x.yml") == "yaml"
    assert detect_format("x.json") == "json"
    assert detect_format("x.txt", "yaml") == "yaml"
    with pytest.raises(RegistryError, match="cannot tell the registry format"):
        detect_format("x.txt")
    with pytest.raises(RegistryError, match="unknown registry format"):
        detect_format("x.py", "ini")


# ---------------------------------------------------------------- concurrency

WRITERS = 50


def _writer(path: str, index: int, go: multiprocessing.synchronize.Event) -> None:
    go.wait()
    write_endpoint(
        path, EndpointEntry(f"alias-{index}", f"model-{index}", f"http://node{index}:8000/v1", "K")
    )


def _reader(path: str, stop: multiprocessing.synchronize.Event, results: multiprocessing.Queue) -> None:
    reads, failures = 0, []
    while not stop.is_set():
        try:
            read_endpoints(path)
            reads += 1
        except Exception as exc:  # any failure at all is what this test is looking for
            failures.append(repr(exc))
    results.put((reads, failures[:5]))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fmt", FORMATS)
def test_concurrent_writers_lose_nothing_and_readers_never_see_a_broken_file(
    tmp_path: Path, fmt: str
) -> None:
    ctx = multiprocessing.get_context("fork")
    path = tmp_path / f"endpoints.{fmt}"
    write_endpoint(path, EndpointEntry("seed", "m", "http://seed:1/v1", "K"))
    go, stop = ctx.Event(), ctx.Event()
    results: multiprocessing.Queue = ctx.Queue()
    reader = ctx.Process(target=_reader, args=(str(path), stop, results))
    reader.start()
    writers = [ctx.Process(target=_writer, args=(str(path), i, go)) for i in range(WRITERS)]
    for process in writers:
        process.start()
    go.set()
    for process in writers:
        process.join(50)
    stop.set()
    reads, failures = results.get(timeout=20)
    reader.join(10)
    assert [p.exitcode for p in writers] == [0] * WRITERS
    assert failures == []
    assert reads > 0
    entries = read_endpoints(path)
    assert set(entries) == {"seed"} | {f"alias-{i}" for i in range(WRITERS)}
    assert entries["alias-7"].url == "http://node7:8000/v1"
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


class _TabFormat:
    """A format a contributor might add: one ``alias<TAB>model<TAB>url<TAB>key_env`` line per entry."""

    name: str = "tab"
    suffixes: tuple[str, ...] = (".tab",)
    holds_secrets: bool = False

    def check(self, text: str, path: Path) -> None:
        self.parse(text, path)

    def parse(self, text: str, path: Path) -> dict[str, EndpointEntry]:
        entries = {}
        for number, line in enumerate(text.splitlines(), 1):
            fields = line.split("\t")
            if len(fields) != 4:
                raise RegistryError(f"{path}: line {number}: expected 4 tab-separated fields")
            entries[fields[0]] = EndpointEntry(*fields)
        return entries

    def upsert(self, text: str | None, entry: EndpointEntry, path: Path,
               api_key: str | None) -> tuple[str, bool]:
        entries = {**self.parse(text or "", path), entry.alias: entry}
        return "".join(f"{e.alias}\t{e.model}\t{e.url}\t{e.key_env}\n" for e in entries.values()), False

    def remove(self, text: str, alias: str, path: Path) -> str | None:
        entries = self.parse(text, path)
        if entries.pop(alias, None) is None:
            return None
        return "".join(f"{e.alias}\t{e.model}\t{e.url}\t{e.key_env}\n" for e in entries.values())


def test_a_format_is_one_entry_in_the_formats_dict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Detection, write, read, remove and the check before a wait all come from ``FORMATS``: a new format
    needs no change in registry.py, and gets its file safety (lock, atomic rename, modes) for free."""
    from pbs_toolkit.endpoints.formats import RegistryFormat
    from pbs_toolkit.endpoints.registry import check_target

    tab: RegistryFormat = _TabFormat()
    monkeypatch.setitem(FORMATS, "tab", tab)
    path = tmp_path / "endpoints.tab"
    assert detect_format(path) == "tab"
    assert write_endpoint(path, NEW) == path
    assert path.read_text() == f"{NEW.alias}\t{NEW.model}\t{NEW.url}\t{NEW.key_env}\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert read_endpoints(path) == {NEW.alias: NEW}
    assert check_target(path) == (path, "tab")
    with pytest.raises(RegistryError, match="never hold the key"):
        write_endpoint(path, NEW, api_key="sk-1")  # holds_secrets=False refuses a key, as for py/toml
    assert remove_endpoint(path, NEW.alias) and path.read_text() == ""
    path.write_text("broken line\n")
    with pytest.raises(RegistryError, match="line 1"):
        check_target(path)


def test_every_shipped_format_is_in_the_dict_under_its_own_name() -> None:
    assert list(FORMATS) == ["py", "toml", "yaml", "json"]
    assert all(fmt.name == name and fmt.suffixes for name, fmt in FORMATS.items())
    assert [name for name, fmt in FORMATS.items() if fmt.holds_secrets] == ["yaml", "json"]


def test_the_cli_format_choices_come_from_the_formats_dict(tmp_path: Path, user_dirs: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """``update-endpoint --format`` offers ``auto`` and every name in ``FORMATS``: a format added there is usable
    from the CLI with no second list to update (a fixed ``click.Choice`` refused it with exit 2)."""
    from tests.helpers import pbstk

    monkeypatch.setitem(FORMATS, "tab", _TabFormat())
    path = tmp_path / "endpoints.txt"  # a suffix no format claims: only --format tab reads it
    path.write_text(f"{NEW.alias}\t{NEW.model}\t{NEW.url}\t{NEW.key_env}\n")
    result = pbstk("update-endpoint", "--remove", NEW.alias, "--registry", str(path), "--format", "tab")
    assert result.exit_code == 0, result.output
    assert path.read_text() == ""
    for command in ("update-endpoint", "run"):  # run --registry writes the same entries
        listed = pbstk(command, "--help").output
        assert "auto|py|toml|yaml|json|tab" in listed.replace("\n", "").replace(" ", ""), command
