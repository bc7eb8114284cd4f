# GPU hosts: build FROM an image with the CUDA userspace your driver supports; the torch wheel
# pinned in pyproject.toml brings its own CUDA libraries.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 MALLOC_ARENA_MAX=2
WORKDIR /app
RUN apt-get update && apt-get install -y --no-install-recommends supervisor \
    && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md ./
COPY worker ./worker
COPY datasets ./datasets
COPY config ./config
COPY pipelines ./pipelines
COPY deploy ./deploy
RUN pip install .
RUN useradd --create-home worker
USER worker
EXPOSE 9464
ENTRYPOINT ["inference-worker"]
CMD ["run"]
