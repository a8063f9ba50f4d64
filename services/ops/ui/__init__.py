"""`streamrl ui`: every run in a browser, live or ended: routes (app), where each run is read (sources), the kept
episode index, the queries, the pages' data (run_view, episode_view) and the static pages."""
