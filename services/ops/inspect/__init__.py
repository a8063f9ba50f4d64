"""Looking at a run: which run a command reads (run_target), serving an ended run's data (serve_ended),
`streamrl runs`, `streamrl episodes` and the views `inspect` and `replay` print."""
