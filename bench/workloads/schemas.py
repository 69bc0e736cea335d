"""JSON schemas and prompts for structured-output workloads (`crossover bench structured`, tests).

Twenty schemas of the shapes applications send: flat and nested objects, arrays of objects,
enums, integers and numbers with bounds, optional fields, string patterns and lengths, and
`$ref` to `$defs`. Every number is bounded in digits (a maximum, or `multipleOf` for
fractions): an unbounded one lets a small model write zeros until max_tokens. Each has a chat prompt that asks
for that kind of object; `PROMPTS` are five subjects each prompt is asked about.
"""

from __future__ import annotations

from typing import Any

_STR = {"type": "string", "maxLength": 40}
_NAME = {"type": "string", "minLength": 1, "maxLength": 30}

SCHEMAS: dict[str, tuple[dict[str, Any], str]] = {
    "person": ({"type": "object", "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0,
                                                                         "maximum": 130}},
                "required": ["name", "age"], "additionalProperties": False},
               "Describe a person connected to {subject}: their name and age."),
    "city": ({"type": "object", "properties": {"name": _NAME, "country": _NAME,
                                               "population": {"type": "integer", "minimum": 0,
                                                              "maximum": 100_000_000}},
              "required": ["name", "country", "population"], "additionalProperties": False},
             "Name a city associated with {subject}, its country and population."),
    "sentiment": ({"type": "object", "properties": {"label": {"enum": ["positive", "negative", "neutral"]},
                                                    "score": {"type": "number", "minimum": 0, "maximum": 1,
                                                              "multipleOf": 0.01}},
                   "required": ["label", "score"], "additionalProperties": False},
                  "Classify the sentiment of this sentence: 'I spent the day thinking about {subject}.'"),
    "todo": ({"type": "object", "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
            "type": "object", "properties": {"task": _STR, "done": {"type": "boolean"}},
            "required": ["task", "done"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False},
        "Write a short to-do list for a project about {subject}."),
    "book": ({"type": "object", "properties": {"title": _STR, "author": _NAME,
                                               "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
                                               "genres": {"type": "array",
                                                          "items": {"type": "string", "maxLength": 20},
                                                          "maxItems": 3}},
              "required": ["title", "author", "year"], "additionalProperties": False},
             "Recommend a book about {subject}."),
    "address": ({"type": "object", "properties": {"street": _STR, "city": _NAME,
                                                  "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                 "required": ["street", "city", "zip"], "additionalProperties": False},
                "Make up a postal address for a shop that sells {subject}."),
    "rgb": ({"type": "object", "properties": {c: {"type": "integer", "minimum": 0, "maximum": 255}
                                              for c in ("r", "g", "b")},
             "required": ["r", "g", "b"], "additionalProperties": False},
            "Give an RGB color that reminds you of {subject}."),
    "event": ({"type": "object", "properties": {"title": _STR,
                                                "date": {"type": "string",
                                                         "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                                                "attendees": {"type": "integer", "minimum": 1,
                                                              "maximum": 10000}},
               "required": ["title", "date", "attendees"], "additionalProperties": False},
              "Plan an event about {subject}: title, date (YYYY-MM-DD) and expected attendees."),
    "yes_no": ({"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "reason": _STR},
                "required": ["answer", "reason"], "additionalProperties": False},
               "Is {subject} useful in everyday life? Answer yes or no with a reason."),
    "recipe": ({"type": "object", "properties": {
        "dish": _STR, "servings": {"type": "integer", "minimum": 1, "maximum": 12},
        "ingredients": {"type": "array", "minItems": 1, "maxItems": 5, "items": {
            "type": "object",
            "properties": {"name": _NAME, "grams": {"type": "integer", "minimum": 1, "maximum": 2000}},
            "required": ["name", "grams"], "additionalProperties": False}}},
        "required": ["dish", "servings", "ingredients"], "additionalProperties": False},
        "Invent a recipe inspired by {subject}."),
    "optional_fields": ({"type": "object", "properties": {"id": {"type": "integer", "minimum": 1,
                                                                 "maximum": 999_999},
                                                          "nickname": _NAME, "email": _STR},
                         "required": ["id"], "additionalProperties": False},
                        "Create a user record for a fan of {subject}; nickname and email are optional."),
    "ref_tree": ({"$defs": {"node": {"type": "object", "properties": {
        "label": {"type": "string", "maxLength": 20},
        "children": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/leaf"}}},
        "required": ["label"], "additionalProperties": False},
        "leaf": {"type": "object", "properties": {"label": {"type": "string", "maxLength": 20}},
                 "required": ["label"], "additionalProperties": False}},
        "type": "object", "properties": {"root": {"$ref": "#/$defs/node"}}, "required": ["root"],
        "additionalProperties": False},
        "Draw a tiny topic tree rooted at {subject}."),
    "ref_points": ({"$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": -100, "maximum": 100, "multipleOf": 0.1},
        "y": {"type": "number", "minimum": -100, "maximum": 100, "multipleOf": 0.1}},
        "required": ["x", "y"], "additionalProperties": False}},
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"], "additionalProperties": False},
        "Give the start and end coordinates of a short walk to see {subject}."),
    "product": ({"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "name": _STR,
        "price": {"type": "number", "minimum": 0, "maximum": 100000, "multipleOf": 0.01},
        "in_stock": {"type": "boolean"}},
        "required": ["sku", "name", "price", "in_stock"], "additionalProperties": False},
        "Describe a product related to {subject} for an online store."),
    "weather": ({"type": "object", "properties": {
        "condition": {"enum": ["sunny", "cloudy", "rain", "snow", "storm"]},
        "celsius": {"type": "integer", "minimum": -60, "maximum": 60},
        "wind_kmh": {"type": "integer", "minimum": 0, "maximum": 300}},
        "required": ["condition", "celsius", "wind_kmh"], "additionalProperties": False},
        "What weather suits {subject} best?"),
    "quiz": ({"type": "object", "properties": {
        "question": _STR, "options": {"type": "array", "minItems": 3, "maxItems": 3,
                                      "items": {"type": "string", "maxLength": 25}},
        "answer_index": {"type": "integer", "minimum": 0, "maximum": 2}},
        "required": ["question", "options", "answer_index"], "additionalProperties": False},
        "Write a multiple-choice question about {subject}."),
    "tags": ({"type": "object", "properties": {"tags": {"type": "array", "minItems": 1, "maxItems": 5,
                                                        "items": {"type": "string",
                                                                  "pattern": "^[a-z]{2,12}$"}}},
              "required": ["tags"], "additionalProperties": False},
             "List lowercase tags for an article about {subject}."),
    "rating": ({"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5},
                                                 "summary": _STR},
                "required": ["stars", "summary"], "additionalProperties": False},
               "Rate {subject} from one to five stars and summarize why."),
    "nested_company": ({"type": "object", "properties": {
        "company": _NAME, "founded": {"type": "integer", "minimum": 1800, "maximum": 2030},
        "ceo": {"type": "object", "properties": {"name": _NAME, "since": {"type": "integer", "minimum": 1800,
                                                                         "maximum": 2030}},
                "required": ["name", "since"], "additionalProperties": False}},
        "required": ["company", "founded", "ceo"], "additionalProperties": False},
        "Invent a company that works on {subject}."),
    "translation": ({"type": "object", "properties": {"source": {"enum": ["en"]},
                                                      "target": {"enum": ["fr", "de", "es", "it"]},
                                                      "text": _STR},
                     "required": ["source", "target", "text"], "additionalProperties": False},
                    "Translate the word '{subject}' into French, German, Spanish or Italian."),
}
"""name -> (JSON schema, chat prompt template with a {subject})."""

SUBJECTS = ("the ocean", "trains", "coffee", "mountains", "music")
"""What each schema's prompt is asked about: five prompts per schema."""


def structured_requests() -> list[tuple[str, dict[str, Any], str]]:
    """(schema name, schema, user message) for every schema and subject: 100 requests."""
    return [(name, schema, prompt.format(subject=s)) for name, (schema, prompt) in SCHEMAS.items()
            for s in SUBJECTS]
