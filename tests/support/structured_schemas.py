"""Twenty JSON schemas for the structured-output tests: varied features, each bounded so a small
model's output ends well inside max_tokens (strings have maxLength, arrays maxItems, numbers bounds)."""
from __future__ import annotations

from typing import Any

NAME = {"type": "string", "minLength": 1, "maxLength": 16}


def _obj(props: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False, **extra}


SCHEMAS: dict[str, tuple[str, dict[str, Any]]] = {
    "person": ("Describe a person.", _obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    "enum_color": ("Pick a color.", _obj({"color": {"enum": ["red", "green", "blue"]}})),
    "boolean_flag": ("Is the sky blue?", _obj({"answer": {"type": "boolean"}})),
    "bounded_number": ("Give a temperature in Celsius.",
                       _obj({"celsius": {"type": "number", "minimum": -50, "maximum": 60}})),
    "array_of_enums": ("List up to three fruits.",
                       _obj({"fruits": {"type": "array", "items": {"enum": ["apple", "pear", "plum", "fig"]},
                                        "minItems": 1, "maxItems": 3}})),
    "nested_object": ("Describe a city and its country.",
                      _obj({"city": NAME, "country": _obj({"name": NAME, "code": {"type": "string",
                                                                                  "pattern": "^[A-Z]{2}$"}})})),
    "optional_fields": ("Describe a book.",
                        _obj({"title": NAME, "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
                              "subtitle": NAME}, required=["title"])),
    "ref_defs": ("Give two points.",
                 {"$defs": {"point": _obj({"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                           "y": {"type": "integer", "minimum": -9, "maximum": 9}})},
                  **_obj({"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}})}),
    "array_of_objects": ("List up to two pets.",
                         _obj({"pets": {"type": "array", "maxItems": 2,
                                        "items": _obj({"name": NAME, "kind": {"enum": ["cat", "dog"]}})}})),
    "const_and_enum": ("Report a status.", _obj({"version": {"const": 1}, "status": {"enum": ["ok", "failed"]}})),
    "integer_range": ("Rate it from 1 to 5.", _obj({"stars": {"type": "integer", "minimum": 1, "maximum": 5}})),
    "string_pattern": ("Give a time of day.",
                       _obj({"time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}})),
    "any_of": ("Give an id, a number or a short code.",
               _obj({"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999},
                                      {"type": "string", "maxLength": 6}]}})),
    "nullable": ("Give a nickname or null.", _obj({"nickname": {"type": ["string", "null"], "maxLength": 10}})),
    "deep_nesting": ("Describe a company.",
                     _obj({"company": _obj({"ceo": _obj({"name": NAME,
                                                          "address": _obj({"city": NAME})})})})),
    "top_level_array": ("List up to three small numbers.",
                        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                         "minItems": 1, "maxItems": 3}),
    "tuple_items": ("Give a name and an age.",
                    {"type": "array", "prefixItems": [NAME, {"type": "integer", "minimum": 0, "maximum": 99}],
                     "items": False, "minItems": 2}),
    "mixed_types": ("Describe a product.",
                    _obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                          "price": {"type": "number", "minimum": 0, "maximum": 999},
                          "in_stock": {"type": "boolean"}, "tags": {"type": "array", "items": NAME, "maxItems": 2}})),
    "enum_of_numbers": ("Pick a dice face.", _obj({"face": {"enum": [1, 2, 3, 4, 5, 6]}})),
    "ref_recursive_bounded": ("Describe a tree of at most two levels.",
                              {"$defs": {"leaf": _obj({"label": NAME})},
                               **_obj({"label": NAME, "children": {"type": "array", "maxItems": 2,
                                                                   "items": {"$ref": "#/$defs/leaf"}}})}),
}
