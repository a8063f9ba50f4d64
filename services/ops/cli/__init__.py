"""`streamrl`: the command line. ``main`` holds the commands, ``args`` their grammar."""
