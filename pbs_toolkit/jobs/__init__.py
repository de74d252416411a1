"""Jobs: render, launch, record (store), status, readiness and the run directory of one served model."""
