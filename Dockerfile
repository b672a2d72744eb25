# One image for both services: the executor uses its CUDA PyTorch and Triton; the scheduler runs
# on the CPU in the same image (one build, one set of pinned dependencies).
FROM pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime
WORKDIR /app
COPY pyproject.toml README.md ./
COPY protos protos
COPY pagedserve pagedserve
COPY scheduler scheduler
COPY executor executor
COPY kernels kernels
RUN pip install --no-cache-dir .
EXPOSE 50051 50061
CMD ["pagedserve", "serve", "--host=0.0.0.0"]
