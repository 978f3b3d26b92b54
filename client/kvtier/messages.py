"""Protobuf messages as plain dicts: every field (defaults included), bytes as hex, enums by name."""

from __future__ import annotations

from google.protobuf.message import Message


def message_to_dict(message: Message) -> dict:
    return {field.name: _value(field, getattr(message, field.name)) for field in message.DESCRIPTOR.fields}


def _value(field, value):
    if isinstance(value, Message):
        return message_to_dict(value)
    if hasattr(value, "items"):  # map field
        return {k: _scalar(field.message_type.fields_by_name["value"], v) for k, v in sorted(value.items())}
    if isinstance(value, (str, bytes, int, float, bool)):
        return _scalar(field, value)
    return [_value(field, item) for item in value]  # repeated field


def _scalar(field, value):
    if isinstance(value, Message):
        return message_to_dict(value)
    if isinstance(value, bytes):
        return value.hex()
    if field.enum_type is not None and isinstance(value, int):
        enum_value = field.enum_type.values_by_number.get(value)
        return enum_value.name if enum_value is not None else value
    return value
