"""A check shared by the tests of the C argument structs that Python packs with ``struct``."""

from __future__ import annotations

import ctypes
import struct


def assert_packs_as_struct(packer: struct.Struct, struct_type: type[ctypes.Structure]) -> None:
    """``packer`` packs one value per scalar field and per array element of ``struct_type``,
    in field order, at the C layout: distinct values packed and read back as the struct land
    in their own fields."""
    values: list[int] = []
    for i, (_, ctype) in enumerate(struct_type._fields_):
        n = ctype._length_ if issubclass(ctype, ctypes.Array) else 1
        values.extend(range(100 * i, 100 * i + n))
    args = struct_type.from_buffer_copy(packer.pack(*values))
    it = iter(values)
    for name, ctype in struct_type._fields_:
        got = getattr(args, name)
        if issubclass(ctype, ctypes.Array):
            assert list(got) == [next(it) for _ in range(ctype._length_)], name
        else:
            assert (got or 0) == next(it), name  # a NULL c_void_p reads as None
    assert packer.size == ctypes.sizeof(struct_type)
