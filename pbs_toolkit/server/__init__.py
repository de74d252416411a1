"""What runs inside the job: the start script (a static bash body behind a rendered settings header)."""
