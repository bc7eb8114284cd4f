# Where torch comes from (docs/operating.md, "Installing on a GPU host"):
# - By default, the exact versions CI runs (constraints.txt): torch 2.14.1's Linux wheel, which
#   brings its own CUDA 13 libraries; the host needs only an NVIDIA driver new enough for CUDA 13
#   (and the NVIDIA container toolkit).
# - From a base image that already holds the torch its CUDA and driver want, with no constraints,
#   so `pip install .` keeps that torch (pyproject.toml asks only for torch>=2.10,<3), e.g.
#     docker build --build-arg BASE=pytorch/pytorch:2.10.0-cuda12.8-cudnn9-runtime \
#                  --build-arg CONSTRAINTS= .
ARG BASE=python:3.11-slim
FROM ${BASE}
# Empty: install against whatever torch the base image has.
ARG CONSTRAINTS=constraints.txt

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 MALLOC_ARENA_MAX=2
WORKDIR /app
RUN apt-get update && apt-get install -y --no-install-recommends supervisor \
    && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md LICENSE constraints.txt ./
COPY worker ./worker
COPY datasets ./datasets
COPY config ./config
COPY pipelines ./pipelines
COPY deploy ./deploy
RUN pip install ${CONSTRAINTS:+-c "$CONSTRAINTS"} ".[ami]"
RUN useradd --create-home worker
USER worker
EXPOSE 9464
ENTRYPOINT ["inference-worker"]
CMD ["run"]
