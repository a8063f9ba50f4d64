"""How a version's weights travel: the delta format and the relay tree."""
