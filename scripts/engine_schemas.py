"""Write the JSON Schemas of the engines' own request and answer models, which the HTTP edge's
tests validate its answers against (tests/http/test_engine_schemas.py), into tests/http/schemas/.

The engines do not install on a CPU test machine (vLLM and SGLang pull CUDA torch and their
serving stacks), so CI never imports them: this script does, once, on a developer's machine, and
the schemas it writes are committed. It installs each pinned release with ``pip install --no-deps``
into a folder of its own (``--target``, kept for the next run), with only the packages the
modules named below import, and imports those modules alone:

- vLLM (``VLLM``): the pydantic models of ``/v1/completions``, ``/inference/v1/generate``,
  ``/v1/models`` and the error body, by ``model_json_schema()``. vLLM's modules import torch,
  transformers and pydantic from the environment this runs in (the project's ``.venv`` has them).
- TRL 1.9 (``TRL``), the last release whose ``trl vllm-serve`` has ``/get_sequence_logprobs/``:
  its request and answer models are classes inside ``trl/scripts/vllm_serve.py``'s ``main``,
  taken from its source as written (``ast``) and built with pydantic alone.
- SGLang (``SGLANG``): ``/generate``'s JSON contract, ``sglang/api/v1/api_types.py`` (generated
  from SGLang's proto files; the server checks each request with it, and its Rust server speaks
  it). Its types are msgspec structs with decoders of their own, so each is turned into a JSON
  Schema here (``_sglang_schema``), and the schemas are checked against SGLang's decoders on
  documents that pass and documents that fail (``_check_sglang``) before anything is written.

``python scripts/engine_schemas.py`` (``--check``: exit 1 where a committed file differs).
"""

from __future__ import annotations

import argparse
import ast
import copy
import importlib
import importlib.metadata
import importlib.util
import json
import subprocess
import sys
import tempfile
import types
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "tests" / "http" / "schemas"

VLLM = "0.33.0"
TRL = "1.9.0"
SGLANG = "0.5.23"

# What the modules below import beyond the project's .venv (found by importing them until they
# imported), installed without their own dependencies.
IMPORTED = [
    "aiohappyeyeballs", "aiohttp", "aiosignal", "cachetools", "cbor2", "cloudpickle", "fastapi",
    "frozenlist", "msgspec", "multidict", "openai-harmony", "opentelemetry-api", "pillow", "propcache",
    "py-cpuinfo", "pybase64", "pyzmq", "uvloop", "yarl",
]  # fmt: skip

VLLM_MODELS = {
    "CompletionRequest": "vllm.entrypoints.openai.completion.protocol",
    "CompletionResponse": "vllm.entrypoints.openai.completion.protocol",
    "GenerateRequest": "vllm.entrypoints.scale_out.token_in_token_out.protocol",
    "GenerateTokensResponse": "vllm.entrypoints.scale_out.token_in_token_out.protocol",
    "ModelList": "vllm.entrypoints.serve.engine.protocol",
    "ErrorResponse": "vllm.entrypoints.serve.engine.protocol",
}
TRL_MODELS = ("SequenceLogprobsRequest", "SequenceLogprobsResponse")
SGLANG_MODELS = ("GenerateRequest", "GenerateResponse", "ErrorBody")


def install(target: Path) -> None:
    """The pinned engines and what their modules import, into ``target`` (once)."""
    if (target / "vllm").is_dir() and (target / "sglang").is_dir() and (target / "trl").is_dir():
        return
    packages = [f"vllm=={VLLM}", f"sglang=={SGLANG}", f"trl=={TRL}", *IMPORTED]
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target)]
    subprocess.run([*pip, *packages], check=True)


def vllm_schemas() -> dict[str, Any]:
    return {
        name: getattr(importlib.import_module(module), name).model_json_schema() for name, module in VLLM_MODELS.items()
    }


def trl_schemas() -> dict[str, Any]:
    """TRL's classes as its source writes them, built outside ``main`` (they use only pydantic)."""
    source = Path(importlib.util.find_spec("trl").origin).parent / "scripts" / "vllm_serve.py"
    tree = ast.parse(source.read_text())
    found = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name in TRL_MODELS}
    namespace: dict[str, Any] = {}
    exec("from pydantic import BaseModel", namespace)
    for name in TRL_MODELS:
        exec(compile(ast.Module(body=[found[name]], type_ignores=[]), str(source), "exec"), namespace)
    return {name: namespace[name].model_json_schema() for name in TRL_MODELS}


# ------------------------------------------------------------------------------------- SGLang

_SCALARS = {int: {"type": "integer"}, float: {"type": "number"}, str: {"type": "string"},
            bool: {"type": "boolean"}, type(None): {"type": "null"}}  # fmt: skip


def _sglang_schema(api: types.ModuleType, names: tuple[str, ...]) -> dict[str, Any]:
    """JSON Schemas of ``api_types``' structs ``names``: a struct whose docstring says ``JSON
    positional array`` is an array of its fields in order, any other an object of them (no other
    keys where the docstring says ``unknown keys rejected``); a field is required where it has no
    default; ``Optional`` and ``Union`` are ``anyOf``, ``List`` an array, ``Dict[str, X]`` an object."""
    import msgspec

    definitions: dict[str, Any] = {}

    def of(hint: Any) -> dict[str, Any]:
        if hint in _SCALARS:
            return dict(_SCALARS[hint])
        if hint is Any:
            return {}
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if origin is typing.Union or origin is types.UnionType:
            return {"anyOf": [of(a) for a in args]}
        if origin is list:
            return {"type": "array", "items": of(args[0])}
        if origin is dict:
            return {"type": "object", "additionalProperties": of(args[1])}
        if isinstance(hint, type) and issubclass(hint, msgspec.Struct):
            if hint.__name__ not in definitions:
                definitions[hint.__name__] = {}
                definitions[hint.__name__] = struct(hint)
            return {"$ref": f"#/$defs/{hint.__name__}"}
        raise TypeError(f"no JSON Schema for {hint!r}")

    def struct(cls: type) -> dict[str, Any]:
        hints = typing.get_type_hints(cls, vars(api))
        fields = msgspec.structs.fields(cls)
        doc = cls.__doc__ or ""
        if "JSON positional array" in doc:
            return {"type": "array", "prefixItems": [of(hints[f.name]) for f in fields],
                    "minItems": len(fields), "maxItems": len(fields)}  # fmt: skip
        schema: dict[str, Any] = {
            "type": "object",
            "properties": {f.name: of(hints[f.name]) for f in fields},
            "required": [f.name for f in fields if f.required],
        }
        if "unknown keys rejected" in doc:
            schema["additionalProperties"] = False
        return schema

    out = {}
    for name in names:
        definitions.clear()
        root = struct(getattr(api, name))
        out[name] = {"$defs": copy.deepcopy(definitions), **root} if definitions else root
    return out


def _check_sglang(api: types.ModuleType, schemas: dict[str, Any]) -> None:
    """The schemas accept what SGLang's decoders accept and refuse what they refuse, on a few
    documents of each kind (``/generate``'s answers and requests as slime and docs/http.md send
    them, and broken ones)."""
    import jsonschema

    entry = [-1.5, 3, None]
    meta = {"id": "r", "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": 3,
            "input_token_logprobs": [[None, 1, None], entry], "input_top_logprobs": [None, [entry]],
            "output_token_logprobs": [], "e2e_latency": 0.1, "weight_versions": []}  # fmt: skip
    request = {"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 0,
               "sampling_params": {"temperature": 0.8, "max_new_tokens": 0, "skip_special_tokens": False}}  # fmt: skip
    cases = {
        "GenerateResponse": [
            {"text": "", "output_ids": [], "meta_info": meta},
            {"text": "", "meta_info": {**meta, "input_token_logprobs": [[None, 1]]}},
            {"text": "", "meta_info": {**meta, "input_token_logprobs": [["x", 1, None]]}},
            {"text": "", "meta_info": {**meta, "input_top_logprobs": [[None]]}},
            {"text": "", "meta_info": {**meta, "prompt_tokens": "3"}},
            {"text": 1},
        ],
        "GenerateRequest": [
            request,
            {**request, "input_ids": [[1, 2], [3]], "rid": ["a", "b"], "top_logprobs_num": 2},
            {**request, "sampling_params": {"max_new_tokens": 0, "unknown": 1}},
            {**request, "input_ids": [1.5]},
            {**request, "return_logprob": "yes"},
        ],
    }
    for name, documents in cases.items():
        decoder = getattr(api, name).from_json_value
        validator = jsonschema.Draft202012Validator(schemas[name])
        for document in documents:
            try:
                decoder(document)
                decoded = True
            except api.JsonContractError:
                decoded = False
            if validator.is_valid(document) != decoded:
                raise SystemExit(f"{name}: the schema and SGLang's decoder disagree on {json.dumps(document)}")


def sglang_schemas() -> dict[str, Any]:
    # The file alone: the sglang package's __init__ imports its serving stack.
    path = Path(importlib.util.find_spec("sglang").origin).parent / "api" / "v1" / "api_types.py"
    spec = importlib.util.spec_from_file_location("sglang_api_types", path)
    api = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = api  # msgspec resolves the structs' annotations through it
    spec.loader.exec_module(api)
    schemas = _sglang_schema(api, SGLANG_MODELS)
    _check_sglang(api, schemas)
    return schemas


def documents() -> dict[str, dict[str, Any]]:
    sources = {
        f"vllm-{VLLM}.json": (VLLM, "vllm", vllm_schemas, sorted(set(VLLM_MODELS.values()))),
        f"trl-{TRL}.json": (TRL, "trl", trl_schemas, ["trl/scripts/vllm_serve.py (main)"]),
        f"sglang-{SGLANG}.json": (SGLANG, "sglang", sglang_schemas, ["sglang.api.v1.api_types"]),
    }
    out = {}
    for file, (version, package, build, modules) in sources.items():
        found = importlib.metadata.version(package)
        if found != version:
            raise SystemExit(f"{package} {found} imported, {version} pinned: clear --target")
        out[file] = {
            "engine": package,
            "version": version,
            "modules": modules,
            "generated_by": "scripts/engine_schemas.py",
            "schemas": build(),
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, help="where the engines are installed (default: a temporary folder)")
    parser.add_argument("--check", action="store_true", help="exit 1 if a committed file differs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        target = (args.target or Path(scratch)).resolve()
        install(target)
        sys.path.insert(0, str(target))
        written = documents()
    stale = []
    OUTPUT.mkdir(parents=True, exist_ok=True)
    for file, document in written.items():
        text = json.dumps(document, indent=1, sort_keys=False) + "\n"
        path = OUTPUT / file
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(file)
        else:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print(f"differs from the engines: {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
