"""Equality and hashing by configuration: a jitted step taking an optimizer as a
static argument does not recompile for an equal one (optax's closures never compare
equal: optax #197, #353, #577; equinox #940). Equal means "builds the same program":
immutable, concrete values compare by value, a tracer by identity (docs/design.md)."""

import dataclasses
import inspect
from typing import Any

import jax
import jax.core
import numpy as np
import optax

from ._leaves import is_typed_key


class _Same:
    """A leaf compared by identity (its `ConfigKey` keeps it alive for its `id`)."""

    __slots__ = ("leaf",)

    def __init__(self, leaf: Any):
        self.leaf = leaf

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.leaf is self.leaf

    def __hash__(self) -> int:
        return id(self.leaf)


def _array_key(x: np.ndarray | np.generic | jax.Array) -> tuple | _Same:
    """A read-only concrete 0-d array or key by kind, dtype, weak type and bits."""
    kind = "jax" if isinstance(x, jax.Array) else "numpy"
    if np.ndim(x) != 0 or (isinstance(x, np.ndarray) and x.flags.writeable):
        return _Same(x)
    try:
        if isinstance(x, jax.Array) and is_typed_key(x):  # only JAX holds keys
            data = np.asarray(jax.random.key_data(x))
            return (kind, "key", str(jax.random.key_impl(x)), data.tobytes())
        bits = np.asarray(x)
    except Exception:  # noqa: BLE001 - unreadable: by identity
        return _Same(x)
    weak = bool(getattr(x, "weak_type", False))
    return (kind, str(bits.dtype), weak, bits.tobytes())


def _leaf_key(leaf: Any) -> tuple | _Same:
    """A leaf's key: numbers by bits; a tracer or mutable leaf by identity."""
    kind = type(leaf)
    if isinstance(leaf, jax.core.Tracer):
        return _Same(leaf)
    if kind is float or kind is complex:
        return (kind, np.asarray(leaf).tobytes())  # float64 or complex128 bits
    if isinstance(leaf, np.ndarray | np.generic | jax.Array):
        return _array_key(leaf)
    try:
        hash(leaf)  # ints, strings, None, dtypes, functions, frozen objects
    except TypeError:
        return _Same(leaf)
    return (kind, leaf)


def _by_value(value: Any) -> tuple | None:
    """A hashable stand-in: structure and `_leaf_key`s; else `None`."""
    try:
        leaves, treedef = jax.tree.flatten(value)
    except Exception:  # noqa: BLE001 - a node that cannot be flattened
        return None
    key = (treedef, tuple(_leaf_key(leaf) for leaf in leaves))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def snapshot(value: Any) -> Any:
    """`value`'s containers rebuilt, so a caller's later change leaves it alone."""
    try:
        return jax.tree.map(lambda leaf: leaf, value)
    except Exception:  # noqa: BLE001 - a node that cannot be rebuilt
        return value


class ConfigKey:
    """One configuration value: equal by `_by_value`, else by identity."""

    __slots__ = ("_hash", "_key", "value")

    def __init__(self, value: Any):
        self.value = value
        self._key = _by_value(value)
        self._hash = id(value) if self._key is None else hash(self._key)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ConfigKey):
            return NotImplemented
        if self._key is None or other._key is None:
            return self.value is other.value
        if self._hash != other._hash:
            return False
        try:
            return bool(self._key == other._key)
        except Exception:  # noqa: BLE001 - a leaf whose `==` gives no bool
            return False

    def __hash__(self) -> int:
        return self._hash


def config_key(*values: Any) -> tuple[ConfigKey, ...]:
    return tuple(ConfigKey(v) for v in values)


@dataclasses.dataclass(frozen=True)
class Method:
    """`owner.name`, equal when the owners are (bound methods compare by identity)."""

    owner: Any
    name: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.owner, self.name)(*args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        """The method's own, for `jax.jit`'s `donate_argnames=`."""
        return inspect.signature(getattr(self.owner, self.name))


class Configured:
    """Equal and hashed by `self._key`; `as_transformation()` gives optax's protocol."""

    _key: tuple

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._key == other._key  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self._key)

    def as_transformation(self) -> optax.GradientTransformationExtraArgs:
        return optax.GradientTransformationExtraArgs(
            Method(self, "init"), Method(self, "update")
        )
