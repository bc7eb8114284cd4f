"""The inference worker service: NATS consumer, batching, inference, results, health, CLI."""
