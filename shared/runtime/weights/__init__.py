"""Moving published weights between processes: the weight server, the fetch client, delta chains, the
origins a worker may send the token to, and the file checksum both sides check."""
