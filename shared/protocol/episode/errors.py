"""The one error a malformed entry raises: it names the entry and the field. Its own module, so that the schema
(events) and the rules it applies (sampling) both raise it without importing each other."""


class EventError(ValueError):
    """An entry that does not follow the schema. Names the entry and the field."""

    def __init__(self, entry_id: str, field: str, problem: str):
        self.entry_id, self.field, self.problem = entry_id, field, problem
        super().__init__(f"entry {entry_id}: field {field!r}: {problem}")
