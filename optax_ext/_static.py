"""Equality and hashing by configuration, so that a jitted step taking an
optimizer as a static argument does not recompile for an equal optimizer.

optax transformations are closures: two `optax.adam(1e-3)` are unequal and
hash differently (optax issues #197, #353, #577; equinox #940). The
transformations of this package compare equal when they were built from
equal configurations.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
import optax


def _by_value(value: Any) -> Any:
    """A hashable stand-in for `value` that equal configurations share: the
    value itself where it is hashable (numbers, strings, functions, tuples of
    those); else, for a pytree (a dict of bools, an Equinox model of bools, a
    0-d array), its structure and its leaves, a 0-d array by its dtype and
    value. `None` where a leaf is neither (a larger array): then the value
    is compared by identity."""
    try:
        hash(value)
        return (type(value), value)
    except TypeError:
        pass
    leaves, treedef = jax.tree.flatten(value)
    keys = []
    for leaf in leaves:
        if isinstance(leaf, np.ndarray | np.generic | jax.Array):
            if np.ndim(leaf) != 0:
                return None
            try:
                item = leaf.item()
            except (
                jax.errors.ConcretizationTypeError,
                jax.errors.TracerArrayConversionError,
            ):  # traced: compared by identity
                return None
            keys.append(("scalar", str(leaf.dtype), item))
            continue
        try:
            hash(leaf)
        except TypeError:
            return None
        keys.append((type(leaf), leaf))
    try:
        hash(treedef)
    except TypeError:
        return None
    return (treedef, tuple(keys))


class ConfigKey:
    """Wraps one configuration value: equal by value where `_by_value` gives
    it a stand-in (numbers, strings, functions, and pytrees of those and of
    0-d arrays), by identity otherwise (larger arrays, Equinox modules
    holding them)."""

    __slots__ = ("_key", "_hash", "value")

    def __init__(self, value: Any):
        self.value = value
        self._key = _by_value(value)
        try:
            self._hash: int | None = None if self._key is None else hash(self._key)
        except TypeError:
            self._key, self._hash = None, None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ConfigKey):
            return NotImplemented
        if self.value is other.value:
            return True
        if self._hash is None or other._hash is None or self._hash != other._hash:
            return False
        try:
            return bool(self._key == other._key)
        except Exception:  # an `==` that does not give a bool
            return False

    def __hash__(self) -> int:
        return self._hash if self._hash is not None else id(self.value)


def config_key(*values: Any) -> tuple[ConfigKey, ...]:
    return tuple(ConfigKey(v) for v in values)


@dataclasses.dataclass(frozen=True)
class Method:
    """`owner.name` as a callable that compares equal when the owners do
    (Python's bound methods compare their owners by identity)."""

    owner: Any
    name: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.owner, self.name)(*args, **kwargs)


class Configured:
    """Equality and hashing by configuration, and the optax protocol.

    A subclass sets `self._key` (a tuple built with `config_key`) in its
    `__init__`; two instances of the same class compare and hash equal when
    their keys do. `as_transformation()` wraps its `init` and `update` as an
    `optax.GradientTransformationExtraArgs` whose functions compare equal
    when the instances do.
    """

    _key: tuple

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._key == other._key  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self._key)

    def as_transformation(self) -> optax.GradientTransformationExtraArgs:
        return optax.GradientTransformationExtraArgs(
            Method(self, "init"), Method(self, "update")
        )
