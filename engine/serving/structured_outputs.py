"""The API's structured-output fields -> one engine constraint (engine/structured_output.py).

Three spellings reach the same grammar: OpenAI's ``response_format`` (``json_schema``, ``json_object``) on chat,
vLLM's ``structured_outputs`` object (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) on chat and
completions, and vLLM's older top-level ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``. Giving two of them is a 400: which one would win is not obvious. Whether the grammar
compiles is decided by the engine's compiler when the request is added (a 400 naming the same field).
"""

from __future__ import annotations

from engine.serving import protocol as p
from engine.serving.errors import APIError
from engine.structured_output import StructuredOutputsParams

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def request_constraint(req: p.SamplingRequest) -> StructuredOutputsParams | None:
    """The constraint a chat or completion request asks for, or None."""
    found = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.type != "text":
        found.append(("response_format", _from_response_format(fmt)))
    if req.structured_outputs is not None:
        found.append(("structured_outputs", _from_structured_outputs(req.structured_outputs)))
    guided = [name for name in _GUIDED if getattr(req, name) is not None]
    if guided:
        found.append((guided[0], _from_guided(req, guided)))
    if len(found) > 1:
        raise APIError(400, f"give one of {', '.join(name for name, _ in found)}: they all constrain the output",
                       found[1][0])
    return found[0][1] if found else None


def _from_response_format(fmt: p.ResponseFormat) -> StructuredOutputsParams:
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True, param="response_format")
    spec = fmt.json_schema or {}
    if not isinstance(spec, dict):
        raise APIError(400, "response_format.json_schema must be an object with a 'schema'", "response_format")
    schema = spec.get("schema")
    if schema is None:
        return StructuredOutputsParams(json_object=True, param="response_format")
    if not isinstance(schema, (dict, bool)):
        raise APIError(400, "response_format.json_schema.schema must be a JSON schema object", "response_format")
    if spec.get("strict") is True:
        schema = closed_objects(schema)
    return StructuredOutputsParams.from_schema(schema, param="response_format")


def closed_objects(schema):
    """OpenAI's strict mode: an object has no properties beyond those it lists. JSON Schema's default lets
    any other key in (pydantic's schemas leave ``additionalProperties`` out), and a model then invents keys;
    a copy with ``additionalProperties: false`` wherever an object with properties does not say."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: closed_objects(value) for key, value in schema.items()}
    if "properties" in closed and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


def _from_structured_outputs(so: p.StructuredOutputs) -> StructuredOutputsParams:
    param = "structured_outputs"
    if so.json_ is not None:
        return StructuredOutputsParams.from_schema(so.json_, param=param)
    return StructuredOutputsParams(regex=so.regex, choice=tuple(so.choice) if so.choice is not None else None,
                                   grammar=so.grammar, json_object=bool(so.json_object), param=param)


def _from_guided(req: p.SamplingRequest, guided: list[str]) -> StructuredOutputsParams:
    if len(guided) > 1:
        raise APIError(400, f"give one of {', '.join(guided)}", guided[1])
    name = guided[0]
    value = getattr(req, name)
    if name == "guided_json":
        return StructuredOutputsParams.from_schema(value, param=name)
    if name == "guided_choice":
        return StructuredOutputsParams(choice=tuple(value), param=name)
    return StructuredOutputsParams(**{name.removeprefix("guided_"): value}, param=name)
