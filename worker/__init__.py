"""The inference worker service, in rooms: the core (``core/``: tasks fetched, admitted, run in
fair batches, settled, drained), the engine (``engine/``: loads and forward passes on their
thread), the task sources (``nats/``, ``antenna/``), health (``health/``: probes, metrics,
guards), the process's assembly (``process/``) and the operator commands (``commands/``)."""
