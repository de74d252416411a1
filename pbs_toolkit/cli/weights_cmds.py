"""``pbstk stage``: fetch and verify a Hub model where the jobs will read it (docs/weights.md)."""

from __future__ import annotations

from typing import Any

import click

from pbs_toolkit.cli.options import build_request, echo_json


@click.command()
@click.argument("model")
@click.option("--profile", "-P", help="Site profile: its hf_home, venv/setup (the job's Python) and login host.")
@click.option("--revision", default="main", show_default=True, help="Branch, tag or commit of the model.")
@click.option("--verify-only", is_flag=True, help="Download nothing: verify what is staged.")
@click.option("--ssh", "ssh_host", help="Stage through this SSH host; none: on this machine.")
@click.option("--account", "-A", help="Project (fills {account} in the profile's hf_home).")
@click.option("--hf-home", help="The model cache the jobs read (HF_HOME); overrides the profile.")
@click.option("--venv", help="Python environment of the jobs (its huggingface_hub downloads).")
@click.option("--accept-new-host-key", is_flag=True, help="Trust an SSH host key not yet in known_hosts.")
@click.option("--json", "as_json", is_flag=True, help="Print the `stage` object (counts and every file's result).")
def stage(model: str, revision: str, verify_only: bool, accept_new_host_key: bool, as_json: bool,
          **kw: Any) -> None:
    """Download MODEL (a Hub id) into the profile's hf_home on the login node and verify every file.

    Each file is checked against the hash its Hub cache blob is named by (sha256 of large files, git sha1 of
    small ones); a snapshot that passes gets a manifest, which `launch`/`serve` on an offline profile require.
    A missing, truncated or corrupt file fails with one line per file (exit 11). --verify-only of a snapshot
    with no manifest and no cached listing (downloaded by the Hugging Face tools) checks the files present and
    the shards its index names, and says the file list itself was not checked.

    \b
      pbstk stage Qwen/Qwen3-8B --profile polaris --account MYPROJ
      pbstk stage Qwen/Qwen3-8B --profile polaris --account MYPROJ --verify-only --json
    """
    from pbs_toolkit.client import Client
    from pbs_toolkit.weights.stage import require_ok

    req = build_request(model, **kw)
    if not verify_only:  # the worker's output comes back at the end: say what is happening meanwhile
        click.echo(f"pbstk: note: staging {model}: downloading what is missing, then hashing every file "
                   f"(no progress is shown until it ends)", err=True)
    with Client(accept_new_host_key=accept_new_host_key) as c:
        report = c.stage(req, revision=revision, verify_only=verify_only)
    if as_json:
        echo_json(report.to_dict())  # also when files failed: their results are the point (exit 11 after)
    else:
        counts = report.counts
        verb = "verified" if verify_only else "staged and verified"
        click.echo(f"{model}@{(report.commit or '?')[:12]}: {counts['ok']}/{counts['files']} files "
                   f"({report.bytes / 1e9:.2f} GB) {verb if report.ok else 'checked'} in {report.hf_home} on "
                   f"{report.where}" + (f"; manifest {report.manifest}" if report.manifest else ""))
    for what in report.unchecked:
        click.echo(f"pbstk: note: {what}", err=True)
    require_ok(report)


COMMANDS = [stage]
