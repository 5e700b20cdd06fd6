"""Overrides: `section.key=value` strings applied to a RunConfig, each converted to its field's type.

Invariants:
- A bad key or value is a one-line ConfigError naming the key and, for unknown keys, the closest valid ones.
- `seed=S` also seeds the data (data.synthetic_seed) and the sampling (generator.seed) unless they are given.
- The result goes through config.validate.validate, so every `auto` is resolved there.
"""
from __future__ import annotations

import difflib
import json
from typing import Any

import msgspec

from config.schema import ConfigError, RunConfig
from config.validate import validate


def _fields(struct_type: type) -> dict[str, Any]:
    info = msgspec.inspect.type_info(struct_type)
    return {f.name: f for f in info.fields}


def _all_keys(struct_type: type, prefix: str = "") -> list[str]:
    keys = []
    for name, f in _fields(struct_type).items():
        full = f"{prefix}{name}"
        keys.append(full)
        if isinstance(f.type, msgspec.inspect.StructType):
            keys.extend(_all_keys(f.type.cls, full + "."))
    return keys


def _parse_value(raw: str) -> Any:
    """A CLI value: JSON where it parses (numbers, bools, lists, dicts), else the plain string."""
    try:
        return json.loads(raw)
    except ValueError:
        low = raw.lower()
        if low in ("true", "false"):
            return low == "true"
        if low in ("none", "null"):
            return None
        return raw


def apply_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """Returns a new config with `a.b=value` overrides applied and validated."""
    data = msgspec.to_builtins(cfg)
    valid = _all_keys(RunConfig)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        if key == "assembler.share_prompt":
            raise ConfigError("config key 'assembler.share_prompt': set learner.share_prompt (the assembler follows it)")
        parts = key.split(".")
        node_type: type = RunConfig
        node = data
        for i, part in enumerate(parts):
            fields = _fields(node_type)
            if part not in fields:
                close = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
                hint = f"; closest: {', '.join(close)}" if close else ""
                raise ConfigError(f"unknown config key {key!r}{hint}")
            ftype = fields[part].type
            if i < len(parts) - 1:
                if isinstance(ftype, msgspec.inspect.StructType):
                    node_type, node = ftype.cls, node[part]
                    continue
                if isinstance(ftype, msgspec.inspect.DictType):
                    # engine_kwargs.compilation_config.level=3 -> nested plain dicts
                    sub = node.setdefault(part, {})
                    for p in parts[i + 1 : -1]:
                        sub = sub.setdefault(p, {})
                    sub[parts[-1]] = _parse_value(raw)
                    break
                raise ConfigError(f"config key {'.'.join(parts[: i + 1])!r} is a value, not a section (in {key!r})")
            if isinstance(ftype, msgspec.inspect.StructType):
                raise ConfigError(f"config key {key!r} is a section; set one of its fields, e.g. {key}.{next(iter(_fields(ftype.cls)))}")
            value = _parse_value(raw)
            if isinstance(ftype, msgspec.inspect.StrType) and not isinstance(value, str):
                value = raw  # "name=123" stays the string "123"
            if isinstance(ftype, msgspec.inspect.ListType):
                if isinstance(value, str):
                    value = [_parse_value(v) for v in value.split(",") if v]
                elif not isinstance(value, list):
                    value = [value]
            node[part] = value
    keys = {item.split("=", 1)[0].strip() for item in overrides}
    if "seed" in keys:  # `seed=S` seeds the data and the sampling too, unless they are given themselves
        for section, field in (("data", "synthetic_seed"), ("generator", "seed")):
            if f"{section}.{field}" not in keys:
                data[section][field] = data["seed"]
    return validate(data)


