"""The driver process: feeds prompt groups, runs validation rounds, shows progress, ends the run."""
