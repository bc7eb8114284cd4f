"""What every benchmark shares, a module a job: ``world`` (local servers, a model, images,
worker processes), ``jobs`` (the one job runner), ``results`` (the one results writer),
``meters`` (memory, CPU, the machine), ``cli`` (the throughput family's command line) and
``stages`` (the throughput benchmark's stages, which ``bench.stages`` runs alone)."""
