"""The tests: ``unit/`` mirrors the package and starts no server; ``integration/`` runs real
nats-servers, S3 (moto) and worker processes; ``chaos/`` injects faults mid-job; ``bench/``
runs the benchmarks' smoke tests. Fakes of what cannot run here (Antenna) are at this level."""
