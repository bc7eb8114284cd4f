# Where torch comes from (docs/operating.md, "Installing on a GPU host"):
# - By default, the exact versions CI runs (constraints.txt): torch 2.14.1's Linux wheel, which
#   brings its own CUDA 13 libraries; the host needs only an NVIDIA driver new enough for CUDA 13
#   (and the NVIDIA container toolkit).
# - From a base image that already holds the torch its CUDA and driver want, with no constraints,
#   so `pip install .` keeps that torch (pyproject.toml asks only for torch>=2.10,<3), e.g.
#     docker build --build-arg BASE=pytorch/pytorch:2.10.0-cuda12.8-cudnn9-runtime \
#                  --build-arg CONSTRAINTS= .
# `make image` builds it with buildah from a Debian base made by mmdebstrap and the wheels this
# machine already has, mounted at WHEELS (docs/operating.md, "The container image").
ARG BASE=python:3.11-slim
FROM ${BASE}
# Empty: install against whatever torch the base image has.
ARG CONSTRAINTS=constraints.txt
# Empty: pip's index; a directory (a build volume): the wheels in it alone, no index asked.
ARG WHEELS=

# The listener on every interface, so /metrics and the probes are reached from outside the
# container (it binds loopback unless told); the model cache on the volume below.
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 MALLOC_ARENA_MAX=2 \
    PATH=/opt/venv/bin:$PATH \
    WORKER_METRICS__HOST=0.0.0.0 \
    WORKER_MODEL__CACHE_DIR=/var/cache/inference-worker/models
WORKDIR /app
RUN command -v supervisord >/dev/null || { apt-get update \
    && apt-get install -y --no-install-recommends supervisor \
    && rm -rf /var/lib/apt/lists/*; }
# A venv: a Debian base's python refuses a system-wide pip install (PEP 668).
RUN python3 -m venv /opt/venv
COPY pyproject.toml README.md LICENSE constraints.txt ./
COPY worker ./worker
COPY datasets ./datasets
COPY config ./config
COPY pipelines ./pipelines
COPY deploy ./deploy
RUN pip install ${WHEELS:+--no-index --find-links "$WHEELS"} ${CONSTRAINTS:+-c "$CONSTRAINTS"} ".[ami]"
# A user of its own, owning the cache alone: the worker refuses a cache directory that is
# another user's or writable by another account (docs/model-files.md, "The cache directory").
RUN useradd --uid 10001 --create-home worker \
    && install -d -m 0755 /var/cache/inference-worker \
    && install -d -o worker -g worker -m 0700 /var/cache/inference-worker/models
VOLUME /var/cache/inference-worker/models
USER worker
EXPOSE 9464
# /livez (200 `ok`, 503 only for what a restart mends); no curl in the image: python asks,
# past any proxy. The start period covers a model load.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request as u; u.build_opener(u.ProxyHandler({})).open('http://127.0.0.1:%s/livez' % os.environ.get('WORKER_METRICS__PORT', '9464'), timeout=4)"]
ENTRYPOINT ["inference-worker"]
CMD ["run"]
