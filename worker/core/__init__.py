"""The core: tasks fetched, admitted, run in fair batches, settled and drained, whatever their
source. It speaks typed tasks and results through its ports (``ports.py``) and imports no
source (``worker/nats/``, ``worker/antenna/``) and nothing of the process's assembly
(``worker/process/``); ``tests/unit/core/test_imports.py`` holds it to that."""
