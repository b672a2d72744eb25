# One image for every pagedserve service: the executor uses its CUDA PyTorch and Triton (or the CPU
# with --device=cpu); the scheduler and the OpenAI gateway run on the CPU in the same image (one
# build, one set of pinned dependencies).
#   docker build -t pagedserve:latest .      (docker compose builds it as well)
FROM pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime

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
