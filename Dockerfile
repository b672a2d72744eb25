# One Dockerfile for every pagedserve service. By default a CPU image: python:3.11-slim with
# PyTorch's CPU wheels (no CUDA libraries, nothing NVIDIA to pull), which runs the scheduler, the
# OpenAI gateway and a CPU executor (--device=cpu). The GPU executor's image takes a CUDA base with
# its own CUDA PyTorch (TORCH_INDEX_URL empty: keep the base's torch):
#   docker build -t pagedserve:latest .                                         (CPU; docker compose up)
#   docker build -t pagedserve:cuda --build-arg BASE=pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime \
#       --build-arg TORCH_INDEX_URL= .                                           (docker-compose.gpu.yml)
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# The package's layout: src/pagedserve plus the four root folders that install as
# pagedserve.protos/.scheduler/.executor/.kernels (pyproject's package-dir). The built-in model
# ships inside the package as package data, so `--model=` (or no --model) serves it with nothing
# mounted. Dependencies first, so that a code change does not reinstall them.
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" \
        > /tmp/requirements.txt \
    && if [ -n "$TORCH_INDEX_URL" ]; then pip install --index-url "$TORCH_INDEX_URL" torch; fi \
    && pip install -r /tmp/requirements.txt
COPY src src
COPY protos protos
COPY scheduler scheduler
COPY executor executor
COPY kernels kernels
RUN pip install --no-deps . \
    && pagedserve executor --help > /dev/null \
    && pagedserve scheduler --help > /dev/null

# Not root. /run/pagedserve holds the internal token (docker-compose.yml's internal-token volume
# takes this directory's owner when first created).
RUN useradd --uid 10001 --create-home pagedserve \
    && mkdir -p /run/pagedserve /model \
    && chown pagedserve:pagedserve /run/pagedserve
USER pagedserve
WORKDIR /home/pagedserve

# 50051 scheduler gRPC, 50061 executor gRPC, 8000 OpenAI gateway, 9090/9091 Prometheus metrics.
EXPOSE 50051 50061 8000 9090 9091
CMD ["pagedserve", "serve", "--host=0.0.0.0"]
