"""The Antenna task source (``WORKER_SOURCE=antenna``): Antenna's jobs listed, tasks reserved
over its HTTP API and read once, results rendered, checked and posted, its answers checked,
the pipelines registered."""
