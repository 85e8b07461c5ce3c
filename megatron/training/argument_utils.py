"""Build argparse groups from config dataclasses, one flag per field (Megatron-LM style).

A field ``micro_batch_size`` becomes ``--micro-batch-size``; its help text is the ``help`` entry of the
field's metadata. Booleans become ``store_true`` flags (``--bf16``), or ``--no-X`` toggles when their default
is ``True``. Lists take several values (``--split 949 50 1``).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(scalar type, is_list) for the annotations we use: int, float, str, bool, Optional[...], list[...]."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    if origin in (list, tuple):
        return typing.get_args(tp)[0], True
    return tp, False


def _nested(field: dataclasses.Field, tp: Any) -> bool:
    """A field holding another config dataclass (a component's config inside a larger one); its fields
    become flags named ``metadata["flag_prefix"] + name``."""
    return dataclasses.is_dataclass(tp) and "flag_prefix" in field.metadata


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type, title: str, prefix: str = "") -> None:
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if not field.init or field.metadata.get("cli") is False:
            continue
        tp, is_list = _base_type(hints[field.name])
        if _nested(field, tp):
            add_dataclass_arguments(parser, tp, f"{title}: {field.metadata.get('help', field.name)}",
                                    prefix + field.metadata["flag_prefix"])
            continue
        dest = prefix + field.name
        help_text = field.metadata.get("help", "")
        default = field.default if field.default is not dataclasses.MISSING else None
        if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = field.default_factory()  # type: ignore[misc]
        kwargs: dict[str, Any] = {"dest": dest, "help": f"{help_text} (default: {default})"}
        if tp is bool and not is_list:
            if default:
                group.add_argument("--no-" + dest.replace("_", "-"), action="store_false", **kwargs)
            else:
                group.add_argument(flag_name(dest), action="store_true", **kwargs)
            continue
        if "choices" in field.metadata:
            kwargs["choices"] = field.metadata["choices"]
        if is_list:
            kwargs["nargs"] = "+"
        group.add_argument(flag_name(dest), type=tp, default=default, **kwargs)


def dataclass_from_args(cls: type[T], namespace: argparse.Namespace, prefix: str = "") -> T:
    """``cls`` from parsed flags (nested component configs from their prefixed flags)."""
    values = {}
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        tp, _ = _base_type(hints[field.name])
        if _nested(field, tp):
            values[field.name] = dataclass_from_args(tp, namespace, prefix + field.metadata["flag_prefix"])
        elif hasattr(namespace, prefix + field.name):
            value = getattr(namespace, prefix + field.name)
            values[field.name] = list(value) if isinstance(value, tuple) else value
    return cls(**values)


def dataclass_from_flags(cls: type[T], **flags: Any) -> T:
    """``cls`` as the flag parser would build it with ``flags`` (flag dest names, e.g. ``ft_policy``) set
    and every other flag at its default (tests, benchmarks)."""
    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, cls, cls.__name__)
    namespace = parser.parse_args([])
    unknown = sorted(set(flags) - set(vars(namespace)))
    if unknown:
        raise ValueError(f"{cls.__name__} has no flag(s) {unknown}")
    for name, value in flags.items():
        setattr(namespace, name, value)
    return dataclass_from_args(cls, namespace)


def non_negative(obj: Any, names: tuple[str, ...], prefix: str) -> None:
    """``ValueError`` naming the flag (``--<prefix><name>``) of the first field in ``names`` below 0."""
    for name in names:
        if getattr(obj, name) < 0:
            raise ValueError(f"--{(prefix + name).replace('_', '-')} must be >= 0, got {getattr(obj, name)}")


def field_help(help_text: str, **extra: Any) -> dict[str, Any]:
    """Metadata for a config field: ``field(default=..., metadata=field_help("..."))``."""
    return {"help": help_text, **extra}
