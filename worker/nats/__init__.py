"""The NATS JetStream task source: connection, provisioning, the feed, subject names, and the
max-deliveries advisories."""
