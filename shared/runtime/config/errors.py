"""The one error a bad config raises: it names the key, what was expected and what it got. Its own module, so that
what the config's keys need (the default folders) can raise it without importing the keys."""


class ConfigError(ValueError):
    pass
