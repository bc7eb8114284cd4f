"""The process's assembly: the device claimed, the served pipelines chosen under the memory
budget, the engine, the health layer and the picked task source built from the settings once,
run by the orchestrator, and taken down in order (``serve.py``)."""
