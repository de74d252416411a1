"""Multi-node layouts at render time (issue 14 point 1): node count from preset and profile, the engine vLLM uses
across nodes, refusals the profile's vLLM version or launcher calls for, ``auto`` sized by weights, and the start
script header the static body reads (``NNODES``, ``NODE_ENGINE``, ``TP``/``PP``/``DP``/``DP_LOCAL``, ...)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import pbstk

from pbs_toolkit.jobs.render import start_body

MODEL = "Qwen/Qwen3-1.7B"
BIG = "meta-llama/Llama-3.1-70B-Instruct"
#: flags the start script's body adds per node at run time; the rendered, shared VLLM_ARGS never has them
RANK_FLAGS = ("--headless", "--data-parallel-address", "--data-parallel-rpc-port", "--data-parallel-start-rank",
              "--nnodes", "--node-rank", "--master-addr", "--master-port")


@pytest.fixture(autouse=True)
def empty_hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A Hugging Face cache of our own: sizes come from the model names (or a config.json a test writes)."""
    hf = tmp_path / "hf"
    hf.mkdir()
    monkeypatch.setenv("HF_HOME", str(hf))
    return hf


def _render(tmp_path: Path, *args: str, model: str = MODEL) -> tuple[str, dict[str, str], list[str]]:
    """Render into a fresh directory; (job script, header settings of start_vllm.sh, VLLM_ARGS as bash sees them)."""
    out = tmp_path / f"r{len(list(tmp_path.glob('r*')))}"
    result = pbstk("render", model, "-o", str(out), *args)
    assert result.exit_code == 0, result.output
    start = (out / "start_vllm.sh").read_text()
    settings = dict(re.findall(r"^([A-Z_]+)=(\S*)$", start, re.MULTILINE))
    # bash itself reads the array: VLLM_ARGS exactly as the body will use it
    block = re.search(r"^VLLM_ARGS=\(\n.*?^\)\n", start, re.MULTILINE | re.DOTALL)
    assert block, start
    argv = subprocess.run(["bash", "-c", block.group(0) + 'printf "%s\\n" "${VLLM_ARGS[@]}"'],  # noqa: S603,S607
                          capture_output=True, text=True, check=True).stdout.splitlines()
    return (out / "job.pbs").read_text(), settings, argv


def _flag(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m pbs_toolkit ARGS`` as a user runs it: exit code and stderr as they are."""
    return subprocess.run([sys.executable, "-m", "pbs_toolkit", *args], capture_output=True, text=True,  # noqa: S603
                          timeout=60, cwd=cwd)


def _one_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pbstk: error: "), result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    return lines[0]


def _profile(tmp_path: Path, **keys: object) -> str:
    """A user profile file: generic-pbspro with ``keys`` changed."""
    base = Path(__file__).parent.parent / "pbs_toolkit" / "settings" / "profiles" / "generic-pbspro.yaml"
    lines = [line for line in base.read_text().splitlines() if line.split(":")[0] not in keys]
    path = tmp_path / f"site-{len(list(tmp_path.glob('site-*')))}.yaml"
    path.write_text("\n".join(lines + [f"{k}: {json.dumps(v)}" for k, v in keys.items()]) + "\n")
    return str(path)


# --- layouts and engines ------------------------------------------------------------------------------


def test_dp8_spans_two_nodes_with_native_data_parallelism(tmp_path: Path) -> None:
    job, settings, argv = _render(tmp_path, "--preset", "dp8", "--profile", "generic-pbspro")
    assert "#PBS -l select=2:ncpus=32:ngpus=4\n" in job
    assert settings.items() >= {"NNODES": "2", "NODE_ENGINE": "dp", "TP": "1", "PP": "1", "DP": "8", "DP_LOCAL": "4",
                             "NODE_LAUNCHER": "pbsdsh", "NCCL_IFNAME": "''", "GLOO_IFNAME": "''"}.items()
    assert _flag(argv, "--data-parallel-size") == "8" and _flag(argv, "--data-parallel-size-local") == "4"
    assert not set(argv) & set(RANK_FLAGS), argv
    assert "--tensor-parallel-size" not in argv and "--distributed-executor-backend" not in argv


def test_several_pbs_nodes_ask_for_one_host_per_chunk(tmp_path: Path) -> None:
    """A real OpenPBS placed ``select=2`` on ONE host that had room for both chunks (its default ``place=free``):
    without ``place`` in the profile, a multi-node job asks for ``scatter``; one node asks for nothing."""
    job, _, _ = _render(tmp_path, "--preset", "dp8", "--profile", "generic-pbspro")
    assert "#PBS -l select=2:ncpus=32:ngpus=4\n" in job and "#PBS -l place=scatter\n" in job
    one, _, _ = _render(tmp_path, "--preset", "dp4", "--profile", "generic-pbspro")
    assert "place=" not in one


def test_polaris_starts_nodes_with_mpiexec(tmp_path: Path) -> None:
    job, settings, _ = _render(tmp_path, "--preset", "dp8", "--profile", "polaris", "--account", "PROJ",
                               "--nodes", "2")
    assert "#PBS -l select=2:system=polaris\n" in job and "#PBS -l place=scatter\n" in job
    assert settings["NODE_LAUNCHER"] == "mpiexec" and settings["NNODES"] == "2"


def test_tp4pp2_crosses_nodes_with_the_nnodes_engine(tmp_path: Path) -> None:
    job, settings, argv = _render(tmp_path, "--preset", "tp4pp2", "--profile", "generic-pbspro")
    assert "#PBS -l select=2:" in job
    assert settings.items() >= {"NNODES": "2", "NODE_ENGINE": "nnodes", "TP": "4", "PP": "2", "DP": "1",
                             "DP_LOCAL": "1"}.items()
    assert _flag(argv, "--tensor-parallel-size") == "4" and _flag(argv, "--pipeline-parallel-size") == "2"
    assert "--data-parallel-size" not in argv and not set(argv) & set(RANK_FLAGS), argv


def test_ray_profile_uses_ray(tmp_path: Path) -> None:
    ray = _profile(tmp_path, multinode_engine="ray", vllm_version="0.10.2")
    _, settings, argv = _render(tmp_path, "--preset", "tp4pp2", "--profile", ray)
    assert settings["NODE_ENGINE"] == "ray"
    assert _flag(argv, "--distributed-executor-backend") == "ray" and _flag(argv, "--pipeline-parallel-size") == "2"
    _, settings, argv = _render(tmp_path, "--preset", "dp8", "--profile", ray)
    assert settings["NODE_ENGINE"] == "ray" and settings["DP_LOCAL"] == "4"
    assert _flag(argv, "--data-parallel-backend") == "ray" and _flag(argv, "--data-parallel-size") == "8"
    assert "--data-parallel-size-local" not in argv and "--distributed-executor-backend" not in argv


def test_one_node_layouts_stay_single(tmp_path: Path) -> None:
    """A preset of one node (or less) renders as before: engine single, no node flags (golden files: test_render)."""
    job, settings, argv = _render(tmp_path, "--preset", "dp4", "--profile", "generic-pbspro")
    assert "#PBS -l select=1:" in job
    assert settings.items() >= {"NNODES": "1", "NODE_ENGINE": "single", "DP": "4", "DP_LOCAL": "4"}.items()
    assert _flag(argv, "--data-parallel-size") == "4" and "--data-parallel-size-local" not in argv
    _, settings, _ = _render(tmp_path, "--preset", "tp8", "--profile", "generic-pbspro", "--gpus-per-node", "8")
    assert settings["NNODES"] == "1" and settings["NODE_ENGINE"] == "single"


def test_nodes_from_config_yaml_must_agree_too(tmp_path: Path, isolated_user: Path) -> None:
    (isolated_user / "config" / "pbstk").mkdir(parents=True, exist_ok=True)
    (isolated_user / "config" / "pbstk" / "config.yaml").write_text("nodes: 2\n")
    _, settings, _ = _render(tmp_path, "--preset", "dp8", "--profile", "generic-pbspro")
    assert settings["NNODES"] == "2"
    line = _one_error(_cli("render", MODEL, "--preset", "dp4", "--profile", "generic-pbspro"))
    assert "preset dp4" in line and "4 GPUs = 1 node(s) of 4 GPUs" in line and "config.yaml" in line, line


def test_local_stand_in_nodes_only_when_asked(tmp_path: Path) -> None:
    """The local scheduler's "nodes" share one host: a preset larger than its node is refused as before unless
    --nodes asks for stand-in nodes (then launcher local, one GPU slice each)."""
    line = _one_error(_cli("render", MODEL, "--preset", "dp2", "--profile", "local-gpu"))
    assert "needs 2 GPU(s) but profile local-gpu requests 1" in line and "--nodes 2 (stand-in nodes" in line, line
    _, settings, argv = _render(tmp_path, "--preset", "dp2", "--profile", "local-gpu", "--nodes", "2")
    assert settings.items() >= {"NNODES": "2", "NODE_ENGINE": "dp", "DP_LOCAL": "1", "NODE_LAUNCHER": "local"}.items()
    assert _flag(argv, "--data-parallel-size-local") == "1"
    _, settings, _ = _render(tmp_path, "--preset", "tp2", "--profile", "local-gpu", "--nodes", "2")
    assert settings.items() >= {"NNODES": "2", "NODE_ENGINE": "nnodes", "TP": "2"}.items()


def test_interface_names_reach_the_header_quoted(tmp_path: Path) -> None:
    site = _profile(tmp_path, nccl_socket_ifname="hsn0,hsn1", gloo_socket_ifname="^lo,docker")
    _, settings, _ = _render(tmp_path, "--preset", "dp8", "--profile", site)
    assert shlex.split(settings["NCCL_IFNAME"]) == ["hsn0,hsn1"]
    assert shlex.split(settings["GLOO_IFNAME"]) == ["^lo,docker"]
    line = _one_error(_cli("render", MODEL, "--preset", "dp8", "--profile",
                           _profile(tmp_path, nccl_socket_ifname="hsn0; rm -rf ~")))
    assert "nccl_socket_ifname" in line, line


# --- refusals: one line, exit 2 -------------------------------------------------------------------------


def test_nodes_mismatch_names_both_numbers() -> None:
    line = _one_error(_cli("render", MODEL, "--preset", "dp8", "--profile", "generic-pbspro", "--nodes", "3"))
    assert line == "pbstk: error: preset dp8 (DP8) needs 8 GPUs = 2 node(s) of 4 GPUs; --nodes 3 gives 12", line
    line = _one_error(_cli("render", MODEL, "--preset", "dp8", "--profile", "generic-pbspro", "--gpus-per-node", "3"))
    assert "8 GPUs" in line and "not a whole number of nodes of 3 GPUs" in line, line


def test_too_old_vllm_names_version_and_minimum(tmp_path: Path) -> None:
    line = _one_error(_cli("render", MODEL, "--preset", "tp4pp2", "--profile", "generic-pbspro",
                           "--vllm-version", "0.10.2"))
    assert line == ("pbstk: error: preset tp4pp2 spans 2 nodes with tensor/pipeline parallelism, which needs vLLM "
                    ">= 0.11.1 (profile says 0.10.2); set vllm_version, or multinode_engine: ray"), line
    line = _one_error(_cli("render", MODEL, "--preset", "dp8", "--profile", "generic-pbspro",
                           "--vllm-version", "0.8.5"))
    assert "data parallelism" in line and ">= 0.9.0" in line and "0.8.5" in line and "ray" not in line, line
    ray = _profile(tmp_path, multinode_engine="ray", vllm_version="0.9.0")
    line = _one_error(_cli("render", MODEL, "--preset", "dp8", "--profile", ray))
    assert "over Ray" in line and ">= 0.9.1" in line and "0.9.0" in line, line


# srun is Slurm's: refused for a PBS profile; an empty value means the scheduler's default (pbsdsh here)
@pytest.mark.parametrize("value", ["srun", "lsrun"])
def test_unknown_launcher_is_refused(tmp_path: Path, value: str) -> None:
    line = _one_error(_cli("render", MODEL, "--preset", "dp8", "--profile", _profile(tmp_path, node_launcher=value)))
    assert "node_launcher" in line and "mpiexec, pbsdsh, ssh" in line and repr(value) in line, line


def test_several_replicas_spanning_nodes_are_refused() -> None:
    line = _one_error(_cli("render", MODEL, "--preset", "tp2dp2", "--profile", "generic-pbspro",
                           "--gpus-per-node", "1"))
    assert "tp2dp2" in line and "multi-node replicas" in line, line


# --- auto sized by weights --------------------------------------------------------------------------------


def test_auto_puts_a_70b_model_on_two_polaris_nodes(tmp_path: Path) -> None:
    job, settings, argv = _render(tmp_path, "--profile", "polaris", "--account", "PROJ", model=BIG)
    assert "#PBS -l select=2:system=polaris\n" in job
    assert settings.items() >= {"NNODES": "2", "NODE_ENGINE": "nnodes", "TP": "4", "PP": "2", "DP": "1"}.items()
    assert _flag(argv, "--tensor-parallel-size") == "4" and _flag(argv, "--pipeline-parallel-size") == "2"
    result = pbstk("presets", "show", "auto", "--model", BIG, "--profile", "polaris")
    assert result.exit_code == 0, result.output
    for text in ("70.0B x 2 bytes", "= 140 GB", "a node holds 4 x 40 GB x 0.95 = 152 GB", "<= 70%",
                 "TP4 x PP2 over 2 nodes", "2 node(s), engine nnodes, launcher mpiexec"):
        assert text in result.output, (text, result.output)
    doc = json.loads(pbstk("presets", "show", "auto", "--model", BIG, "--profile", "polaris", "--json").output)
    assert doc["plan"] == {"nnodes": 2, "engine": "nnodes", "tensor_parallel": 4, "pipeline_parallel": 2,
                           "data_parallel": 1, "data_parallel_local": 1, "launcher": "mpiexec"}


def test_auto_too_few_nodes_says_how_many(tmp_path: Path) -> None:
    line = _one_error(_cli("render", BIG, "--profile", "polaris", "--account", "PROJ", "--nodes", "1"))
    assert "TP4 x PP2 over 2 nodes" in line and "--nodes 1 is too few; pass --nodes 2" in line, line


def test_auto_reads_the_dtype_from_config_json(tmp_path: Path) -> None:
    """An fp8 checkpoint of the same 70B model (1 byte a weight) fits one node: TP4."""
    model = tmp_path / "llama-70b-fp8"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "hidden_size": 8192, "num_hidden_layers": 80, "intermediate_size": 28672, "num_attention_heads": 64,
        "num_key_value_heads": 8, "vocab_size": 128256, "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8"}}))
    site = _profile(tmp_path, gpu_memory_gb=40)  # polaris-like, without an SSH host: the directory is read here
    _, settings, _ = _render(tmp_path, "--profile", site, model=str(model))
    assert settings.items() >= {"NNODES": "1", "NODE_ENGINE": "single", "TP": "4", "PP": "1", "DP": "1"}.items()
    result = pbstk("presets", "show", "auto", "--model", str(model), "--profile", site)
    assert "70.6B x 1 bytes (fp8) = 71 GB" in result.output and "-> TP4 x DP1" in result.output, result.output


def test_auto_with_more_nodes_fills_them_with_replicas(tmp_path: Path) -> None:
    _, settings, argv = _render(tmp_path, "--profile", "polaris", "--account", "PROJ", "--nodes", "2",
                                model="Qwen/Qwen3-14B")
    # 14B x 2 = 28 GB: over 70% of one 38 GB share (27 GB), within two -> TP2, and DP over the 8 GPUs
    assert settings.items() >= {"NNODES": "2", "NODE_ENGINE": "dp", "TP": "2", "DP": "4", "DP_LOCAL": "2"}.items()
    assert _flag(argv, "--data-parallel-size-local") == "2"


def test_auto_without_gpu_memory_keeps_the_parameter_rule(tmp_path: Path) -> None:
    _, settings, _ = _render(tmp_path, "--profile", "generic-pbspro", model=BIG)
    assert settings.items() >= {"NNODES": "1", "TP": "4", "PP": "1"}.items()


# --- the rendered scripts are clean -------------------------------------------------------------------------


def test_multinode_scripts_pass_shellcheck(tmp_path: Path) -> None:
    ray = _profile(tmp_path, multinode_engine="ray", nccl_socket_ifname="hsn0")
    cases = [("dp8", "generic-pbspro"), ("tp4pp2", "polaris"), ("tp8", "polaris"), ("dp8", ray), ("tp4pp2", ray),
             ("dp2", "local-gpu", "--nodes", "2"), ("tp2", "local-gpu", "--nodes", "2")]
    files: list[str] = []
    for preset, profile, *extra in cases:
        out = tmp_path / f"sc{len(files)}"
        result = pbstk("render", MODEL, "-o", str(out), "--preset", preset, "--profile", profile, "--account", "P",
                       *extra)
        assert result.exit_code == 0, result.output
        files += [str(p) for p in sorted(out.iterdir()) if p.suffix in (".pbs", ".slurm", ".sh")]
    for path in files:
        subprocess.run(["bash", "-n", path], check=True)  # noqa: S603,S607
    # A start script is a header (this launch's variables) and the same static body: shellcheck reads the first
    # start script whole, the others' headers alone (~1 s of CPU each saved; the body's variables are read only by
    # the body, so "assigned but unused", SC2034, is expected in a header and only there).
    body = start_body()
    starts = [p for p in files if p.endswith("start_vllm.sh")]
    headers = []
    for path in starts[1:]:
        text = Path(path).read_text()
        assert text.endswith(body), path
        header = Path(f"{path}.header")
        header.write_text(text[: -len(body)])
        headers.append(str(header))
    whole = [p for p in files if p not in starts[1:]]
    check = subprocess.run(["shellcheck", *whole], capture_output=True, text=True)  # noqa: S603,S607
    assert check.returncode == 0, check.stdout
    check = subprocess.run(["shellcheck", "-e", "SC2034", *headers], capture_output=True, text=True)  # noqa: S603,S607
    assert len(headers) == len(cases) - 1 and check.returncode == 0, check.stdout
