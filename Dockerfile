# megatron-adacc on an NVIDIA PyTorch container.
#
# The default base keeps CUDA 12.x, which still supports V100 (Volta; CUDA 13 dropped it), and
# ships Python 3.12, which megatron-core 0.19 requires (NGC's images have since 24.10); pick a
# newer one with --build-arg BASE_IMAGE=... Build and run lines: README, "Docker".
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:24.12-py3
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    ADACC_DATA_DIR=/workspace/adacc-cache

WORKDIR /workspace/megatron-adacc

# The container's own CUDA build of torch must stay. Every pip install runs under a
# constraint pinning torch to the base image's build (PIP_CONSTRAINT, so later installs in
# the container keep it too); megatron-core, whose torch>=2.6.0 NGC's 2.6.0a0+... builds do
# not satisfy, is installed with --no-deps beside its other dependencies (its "training"
# extra, Megatron-LM's loop, with theirs).
COPY requirements-gpu.txt requirements-gpu-megatron.txt ./
RUN python -c "import sys; assert sys.version_info[:2] >= (3, 12), \
'megatron-core 0.19 needs Python 3.12: pick a BASE_IMAGE of 24.10 or later'" \
    && python -c "import torch; print(f'torch=={torch.__version__}')" > /etc/pip-torch-constraint.txt
ENV PIP_CONSTRAINT=/etc/pip-torch-constraint.txt
RUN pip install --no-cache-dir -r requirements-gpu.txt \
    && pip install --no-cache-dir --no-deps -r requirements-gpu-megatron.txt

COPY setup.py README.md pretrain_gpt.py ./
COPY megatron_adacc ./megatron_adacc
COPY configs ./configs
COPY scripts ./scripts
RUN pip install --no-cache-dir --no-deps -e . \
    && python -c "import megatron_adacc, megatron.core; print('megatron-adacc', megatron_adacc.__version__)"

# Fail the build if any install above replaced the base image's CUDA torch.
RUN python -c "import torch; pin = open('/etc/pip-torch-constraint.txt').read().strip(); \
assert f'torch=={torch.__version__}' == pin and torch.version.cuda, (torch.__version__, pin)"

# No ENTRYPOINT of our own: the base image's runs the command as given, so the README's
# `docker run ... megatron-adacc torchrun ...` and `... python scripts/gpu_check.py` work as
# written; with no command the image trains the 345M model on every GPU.
CMD ["torchrun", "--nproc_per_node", "gpu", "pretrain_gpt.py", "--config", "configs/gpt-345m.yaml"]
