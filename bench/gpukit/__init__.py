"""The GPU kit (issue 42): every GPU check in one call of the device tool.

Two commands (BENCHMARKS.md, "The GPU path"):

- ``python3 -m bench.gpukit gather`` (``make gpu-kit``), on a machine with network: the wheels of
  every dependency the lent GPU machine lacks, for its Python and platform, into ``.gpukit/``,
  within what the device tool carries (``gather``, ``machine``).
- ``python3 -m bench.gpukit run --device cuda``, there, offline: installs those wheels into a
  folder of its own and runs, each bounded by its own timeout, the CUDA-only tests, a whole
  ``inference-worker run --until-idle`` serving a detector pipeline on 4K JPEGs against a local
  nats-server and S3 endpoint (``serve``), and ``bench.gpu``; prints one JSON report (``run``).

Only the standard library is imported here, in ``machine``, ``gather`` and ``run``: they work
before anything is installed. ``serve`` runs after the install, in a process of its own.
"""
