"""docs/megatron-lm.md: the lines it tells a Megatron-LM user to add run as written, in a loop
built from megatron.training, and are the calls this project's pretrain_gpt.py makes."""
import json
import re
from pathlib import Path


from helpers.pretrain import PRETRAIN, ROOT, TINY, losses, run, train

DOC = (ROOT / "docs" / "megatron-lm.md").read_text()


def _section(title: str) -> str:
    return DOC.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def _snippet() -> str:
    (code,) = re.findall(r"```python\n(.*?)```", _section("The lines to add"), re.S)
    return code


def _cpu_flags() -> list[str]:
    (flags,) = re.findall(r"pass those as\s+Megatron-LM's flags: `([^`]+)`",
                          _section("On a CPU"))
    return flags.split()


def test_pretrain_gpt_makes_the_pages_two_calls():
    from megatron_adacc import launch, megatron_lm

    code = _snippet()
    assert "extra_args_provider=megatron_lm.add_arguments" in code
    assert "megatron_lm.install(model_cfg, args)" in code
    # pretrain_gpt.py: install right after gpt_config_from_args; its parser (launch.parse)
    # takes the very same extra_args_provider
    source = Path(PRETRAIN).read_text()
    assert source.index("megatron_lm.install(model_cfg, args)") > \
        source.index("gpt_config_from_args(args)")
    assert "parse_args(extra_args_provider=add_arguments)" in Path(launch.__file__).read_text()
    assert launch.add_arguments is megatron_lm.add_arguments


# Megatron-LM's own flags for the loop of the page: mock data, the auto policy, which profiles
# through the script's forward_step, at a budget that keeps every activation (exact, so the
# losses can be compared bit for bit).
FLAGS = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "257",
         "--train-iters", "2", "--adacc-policy", "auto", "--adacc-memory-budget", "1GiB"]


def test_the_pages_lines_run_in_a_megatron_lm_loop(tmp_path):
    from megatron_adacc import launch

    script = tmp_path / "megatron_lm_pretrain_gpt.py"
    # A Megatron-LM pretrain_gpt.py's main block: its imports, this project's forward_step
    # and dataset provider in place of Megatron-LM's, the host's CPU shims, then the page's
    # lines exactly. Its forward_step runs as Megatron-LM's does: under a StragglerDetector,
    # which logs every exception passing through, and checking its loss with the rerun state
    # machine (this project's loss function does that too).
    script.write_text(
        "import json, sys\n"
        "from megatron_adacc import megatron_compat\n"
        "megatron_compat.apply_training()\n"
        "from megatron.core.enums import ModelType\n"
        "from megatron.training import pretrain\n"
        "from megatron.training.argument_utils import (gpt_config_from_args,\n"
        "                                              pretrain_cfg_container_from_args)\n"
        "from megatron.training.arguments import parse_and_validate_args\n"
        "from pretrain_gpt import datasets_provider as train_valid_test_datasets_provider\n"
        "from megatron.core.utils import StragglerDetector\n"
        "import pretrain_gpt\n"
        "stimer = StragglerDetector()\n"
        "def forward_step(data_iterator, model):\n"
        "    with stimer:\n"
        "        return pretrain_gpt.forward_step(data_iterator, model)\n"
        "train_valid_test_datasets_provider.is_distributed = True\n"
        + _snippet()
        + "session = megatron_lm.session()\n"
        "print('SESSION', json.dumps({'records': session.records,\n"
        "                             'plan_id': session.adacc.plan_id}), file=sys.stderr)\n")
    flags = [*launch.config_argv(TINY), *FLAGS, *_cpu_flags()]
    # run() also finds no traceback in the output: the profiler ends a pass past the layer it
    # measures with an exception, which the detector would log at every profiled step.
    status, _, stderr = run(script, *flags, "--metrics-file", tmp_path / "m.jsonl",
                            cwd=tmp_path, nproc=1)
    assert status == 0, stderr[-3000:]
    seen = json.loads(stderr.split("SESSION ", 1)[1].splitlines()[0])
    assert seen["plan_id"] != "none"
    assert [r["iteration"] for r in seen["records"]] == [1, 2]
    assert all(r["activation_bytes"] > 0 for r in seen["records"])
    written = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert losses(written) == losses(seen["records"])
    # this project's pretrain_gpt.py, the same flags: the same losses, bit for bit (on one
    # thread, as run() gives the script: a thread count changes float reductions)
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ours = losses(train(*FLAGS))
    finally:
        torch.set_num_threads(threads)
    assert ours == losses(seen["records"])
