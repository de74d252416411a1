"""Model weights on the cluster's shared filesystem: ``pbstk stage`` (fetch + verify + manifest, stage.py), the
launch-time preflight (preflight.py) and where the Hub cache keeps things (manifest.py). docs/weights.md."""
