"""What every layer shares: the stage registry, artifact paths, manifests and atomic writes,
config and its schema, devices and numerics, resume states, errors and code hashes."""
