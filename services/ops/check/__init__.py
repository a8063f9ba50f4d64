"""`streamrl check`, the end-of-run check: reading a run back (data), counting what exactly-once forbids
(counts) and printing the verdict (report)."""
