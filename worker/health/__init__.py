"""Health: liveness, metrics, the /metrics + /healthz server, resource guards, process
statistics and the watchdog."""
