"""The operator's side, the composition root: the `streamrl` command (cli), starting and keeping a run (launch),
the end-of-run check (check), looking at runs (inspect), replaying episodes (replay) and the browser ui (ui)."""
