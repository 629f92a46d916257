"""JSON Schemas the structured-output tests hold answers to (bounded strings and enums, so
that even the small default model's answers end as the schema does)."""

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "enum": ["France", "Germany", "Italy"]},
    },
    "required": ["city", "country"],
    "additionalProperties": False,
}
