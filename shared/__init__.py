"""What every process shares: the wire protocol (``protocol``) and the process runtime (``runtime``)."""
