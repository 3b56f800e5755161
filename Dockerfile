# megatron-adacc on an NVIDIA PyTorch container.
#
# The default base keeps CUDA 12.x, which still supports V100 (Volta; CUDA 13 dropped it).
# For newer GPUs pick a newer base:
#   docker build -t megatron-adacc .
#   docker build --build-arg BASE_IMAGE=nvcr.io/nvidia/pytorch:25.09-py3 -t megatron-adacc:h100 .
# Run (one node, 8 GPUs):
#   docker run --gpus all --ipc=host --ulimit memlock=-1 -v /data:/data megatron-adacc \
#     torchrun --nproc_per_node 8 pretrain_gpt.py --config configs/gpt-345m.yaml \
#       --data-path /data/pile_text_document --adacc-policy auto
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:24.12-py3
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    ADACC_DATA_DIR=/workspace/adacc-cache

WORKDIR /workspace/megatron-adacc

# The container's own CUDA build of torch must stay: the dependencies are installed without
# letting pip resolve torch, then the package itself with --no-deps.
COPY requirements-gpu.txt ./
RUN pip install --no-cache-dir -r requirements-gpu.txt

COPY setup.py README.md pretrain_gpt.py ./
COPY megatron_adacc ./megatron_adacc
COPY configs ./configs
COPY scripts ./scripts
RUN pip install --no-cache-dir --no-deps -e . \
    && python -c "import megatron_adacc, megatron.core; print('megatron-adacc', megatron_adacc.__version__)"

ENTRYPOINT ["torchrun", "--nproc_per_node", "gpu"]
CMD ["pretrain_gpt.py", "--config", "configs/gpt-345m.yaml"]
