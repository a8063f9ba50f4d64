"""The processes of a run, one package each. None imports a sibling; ``ops`` (the CLI) composes them all."""
