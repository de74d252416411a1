"""Performance: metrics scrape, doctor findings, the load generator, bench jobs and preset tuning."""
