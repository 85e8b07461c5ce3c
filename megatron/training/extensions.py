"""What the training loop calls on an extra argument group: one declared interface, no ``hasattr`` probing.

``parse_args(argv, extra_groups=[(title, cls), ...])`` builds one config object per extra group (one flag
per dataclass field, ``argument_utils.py``). The loop then calls, on every one of them, in this order:

* ``adjust_parallel(args)`` -- before Megatron's argument validation: re-derive parallel sizes for the
  world this start was given (an elastic restart on fewer nodes); returns log lines of what changed;
* ``emulates_fp8`` -- whether the group makes FP8 work without Transformer Engine (validation asks);
* ``check_args(args)`` -- after validation: checks of the group's flags against the model's, a
  ``ValueError`` naming the fix;
* ``customize_layer_spec(spec)`` -- at model build: adapt the transformer layer spec (Megatron-Core's
  ``ModuleSpec`` seam: router, MoE layer or linear subclasses);
* ``after_optimizer_built(model_chunks, optimizer, args)`` -- once the optimizer exists.

A group subclasses :class:`LoopExtension` (the no-op defaults) and overrides what it needs;
``parse_args`` refuses a group that does not implement :class:`Extension`.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Extension(Protocol):
    """The hooks the loop calls on every extra argument group."""

    @property
    def emulates_fp8(self) -> bool: ...

    def adjust_parallel(self, args: Any) -> list[str]: ...

    def check_args(self, args: Any) -> None: ...

    def customize_layer_spec(self, spec: Any) -> Any: ...

    def after_optimizer_built(self, model_chunks: list, optimizer: Any, args: Any) -> None: ...


class LoopExtension:
    """No-op implementations of :class:`Extension`, for extra argument groups to subclass."""

    @property
    def emulates_fp8(self) -> bool:
        return False

    def adjust_parallel(self, args: Any) -> list[str]:
        return []

    def check_args(self, args: Any) -> None:
        return None

    def customize_layer_spec(self, spec: Any) -> Any:
        return spec

    def after_optimizer_built(self, model_chunks: list, optimizer: Any, args: Any) -> None:
        return None


def check_extension(obj: object) -> Extension:
    """``obj`` as an :class:`Extension`, or a ``TypeError`` naming the fix."""
    if not isinstance(obj, Extension):
        raise TypeError(f"extra argument group {type(obj).__name__} does not implement the loop's hooks: "
                        "subclass megatron.training.extensions.LoopExtension")
    return obj
