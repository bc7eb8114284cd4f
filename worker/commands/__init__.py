"""Operator commands: the CLI, the client side (submit, results), job progress, check, the
demo and its local servers, and healthwatch (a supervisord event listener)."""
