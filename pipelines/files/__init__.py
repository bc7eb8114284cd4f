"""Model files (weights, labels) by URI: read from a path, or downloaded once per host into a
cache directory, checked against a declared or recorded sha256 (``fetch.ModelFiles``)."""
