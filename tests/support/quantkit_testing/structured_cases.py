"""The JSON schemas that tests/server/test_structured_outputs.py sends: 30 of varied features (nested
objects, arrays with min/max items, enums, const, anyOf, bounded numbers, string patterns and lengths,
required and optional fields, $defs/$ref, null, booleans). Every value is bounded in length, so that an
answer of the tests' tiny random model fits its 256-token context whatever it picks."""

NAME = {"type": "string", "maxLength": 6}
WORD = {"type": "string", "pattern": "^[a-z]{1,5}$"}
SMALL = {"type": "integer", "minimum": 0, "maximum": 99}


def obj(properties: dict, required=None) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, "additionalProperties": False}


SCHEMAS = [
    obj({"name": NAME, "age": SMALL}),
    obj({"ok": {"type": "boolean"}}),
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"kind": {"const": "point"}, "x": SMALL, "y": SMALL}),
    obj({"score": {"type": "number", "minimum": 0, "maximum": 1}}),
    obj({"t": {"type": "number", "minimum": -40.5, "maximum": 60}}),
    obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    obj({"tags": {"type": "array", "items": WORD, "minItems": 1, "maxItems": 3}}),
    obj({"pair": {"type": "array", "items": SMALL, "minItems": 2, "maxItems": 2}}),
    obj({"user": obj({"id": SMALL, "name": NAME})}),
    obj({"a": obj({"b": obj({"c": {"type": "boolean"}})})}),
    obj({"name": NAME, "nick": NAME}, required=["name"]),
    obj({"id": SMALL, "note": WORD, "flag": {"type": "boolean"}}, required=["id"]),
    obj({"v": {"anyOf": [SMALL, {"type": "boolean"}]}}),
    obj({"v": {"anyOf": [obj({"cat": WORD}), obj({"dog": SMALL})]}}),
    obj({"maybe": {"anyOf": [NAME, {"type": "null"}]}}),
    obj({"items": {"type": "array", "items": obj({"sku": {"type": "string", "pattern": "^[0-9]{4}$"},
                                                      "qty": {"type": "integer", "minimum": 1, "maximum": 9}}),
                   "minItems": 1, "maxItems": 2}}),
    obj({"level": {"enum": [1, 2, 3]}, "label": {"enum": ["low", "mid", "high"]}}),
    obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}),
    obj({"grid": {"type": "array", "minItems": 1, "maxItems": 2,
                  "items": {"type": "array", "items": {"enum": [0, 1]}, "minItems": 2, "maxItems": 2}}}),
    {"type": "array", "items": SMALL, "minItems": 1, "maxItems": 4},
    {"enum": ["yes", "no"]},
    {"type": "integer", "minimum": 10, "maximum": 20},
    {"type": "string", "pattern": "^(cat|dog|bird)s?$"},
    {"$defs": {"pt": obj({"x": SMALL, "y": SMALL})}, **obj({"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}})},
    obj({"name": {"type": "string", "minLength": 2, "maxLength": 4}}),
    obj({"price": {"type": "number", "minimum": 0.5, "maximum": 9.5}, "currency": {"enum": ["EUR", "USD"]}}),
    obj({"event": obj({"title": WORD, "when": obj({"h": {"type": "integer", "minimum": 0, "maximum": 23},
                                                    "m": {"type": "integer", "minimum": 0, "maximum": 59}})})}),
    obj({"status": {"anyOf": [{"const": "done"}, obj({"progress": SMALL})]}}),
    obj({"nums": {"type": "array", "items": {"type": "number", "minimum": -1, "maximum": 1}, "maxItems": 3},
         "empty": {"type": "null"}}),
]
assert len(SCHEMAS) == 30
