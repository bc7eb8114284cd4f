"""What the benchmarks share, a module a job: ``world`` (local servers, a model, images,
worker processes), ``jobs`` (a NATS client and the one job runner), ``results`` (the one
results writer), ``meters`` (memory, CPU, the machine), ``cli`` (the throughput benchmark's
command line), ``stages`` (the throughput benchmark's stages) and ``ami_pattern`` (AMI's
detect-and-classify pattern, which ``bench.workload`` runs to compare against)."""
