"""Process runtime: config, connection, logs, the service lifecycle and heartbeat, files."""
