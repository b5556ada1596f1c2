"""Write arrays one at a time into a ``.npz`` or ``.safetensors`` file, holding only the current one.

``gk.inspect`` can keep the full output of every node; a model's intermediate tensors together do
not fit in memory, so each is written as soon as it is computed. ``.npz`` (numpy's zip of ``.npy``
files) is written entry by entry; ``.safetensors`` (a JSON header with every tensor's offsets,
then the raw bytes) is written to a side file first and given its header at the end. bfloat16 goes
into ``.npz`` as float32 (numpy has no bfloat16) and into ``.safetensors`` as BF16.

>>> import os, tempfile, mlx.core as mx
>>> path = os.path.join(tempfile.mkdtemp(), "values.safetensors")
>>> with open_writer(path) as out:
...     out.add("x", mx.arange(3, dtype=mx.bfloat16))
>>> mx.load(path)["x"].tolist()
[0.0, 1.0, 2.0]
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
import zipfile
from typing import Any

import mlx.core as mx
import numpy as np

from ..nodes import KernelError, Status, dtype_name

__all__ = ["TensorWriter", "open_writer"]

_SAVE = "save node values"
_SAFETENSORS_DTYPES = {
    "bool": "BOOL", "uint8": "U8", "uint16": "U16", "uint32": "U32", "uint64": "U64", "int8": "I8",
    "int16": "I16", "int32": "I32", "int64": "I64", "float16": "F16", "bfloat16": "BF16",
    "float32": "F32", "float64": "F64", "complex64": "C64",
}


class TensorWriter:
    """Adds arrays to one file under unique keys; a context manager (the file is complete, and
    renamed into place, on a clean exit; removed on an error)."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        folder = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(folder):
            raise KernelError(_SAVE, f"folder {folder} does not exist", Status.INVALID_INPUT)
        self.keys: list[str] = []
        fd, self._partial = tempfile.mkstemp(dir=folder, prefix=".graphkern-", suffix=".partial")
        os.close(fd)

    def add(self, key: str, array: mx.array) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> TensorWriter:
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        try:
            if kind is None:
                self._finish()
                os.replace(self._partial, self.path)
        finally:
            if os.path.exists(self._partial):
                os.remove(self._partial)


class _NpzWriter(TensorWriter):
    def __init__(self, path: str | os.PathLike[str]):
        super().__init__(path)
        self._zip = zipfile.ZipFile(self._partial, "w", allowZip64=True)

    def add(self, key: str, array: mx.array) -> None:
        if array.dtype == mx.bfloat16:
            array = array.astype(mx.float32)
        with self._zip.open(f"{key}.npy", "w", force_zip64=True) as entry:
            np.lib.format.write_array(entry, np.asarray(array), allow_pickle=False)
        self.keys.append(key)

    def _finish(self) -> None:
        self._zip.close()

    def __exit__(self, kind: Any, *rest: Any) -> None:
        if kind is not None:
            self._zip.close()
        super().__exit__(kind, *rest)


class _SafetensorsWriter(TensorWriter):
    def __init__(self, path: str | os.PathLike[str]):
        super().__init__(path)
        # closed in _finish or __exit__
        self._data = tempfile.TemporaryFile(dir=os.path.dirname(os.path.abspath(self.path)))  # noqa: SIM115
        self._header: dict[str, Any] = {}
        self._offset = 0

    def add(self, key: str, array: mx.array) -> None:
        name = dtype_name(array.dtype)
        if array.dtype == mx.bfloat16:  # numpy has no bfloat16: its bits, as they are
            data = np.asarray(array.view(mx.uint16)).tobytes()
        else:
            data = np.ascontiguousarray(np.asarray(array)).tobytes()
        self._data.write(data)
        self._header[key] = {"dtype": _SAFETENSORS_DTYPES[name], "shape": list(array.shape),
                             "data_offsets": [self._offset, self._offset + len(data)]}
        self._offset += len(data)
        self.keys.append(key)

    def _finish(self) -> None:
        header = json.dumps(self._header, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned
        with open(self._partial, "wb") as out:
            out.write(struct.pack("<Q", len(header)))
            out.write(header)
            self._data.seek(0)
            shutil.copyfileobj(self._data, out)
        self._data.close()

    def __exit__(self, kind: Any, *rest: Any) -> None:
        if kind is not None:
            self._data.close()
        super().__exit__(kind, *rest)


def open_writer(path: str | os.PathLike[str]) -> TensorWriter:
    """A writer for ``path``, by its suffix: ``.npz`` or ``.safetensors``."""
    suffix = os.path.splitext(os.fspath(path))[1].lower()
    if suffix == ".npz":
        return _NpzWriter(path)
    if suffix == ".safetensors":
        return _SafetensorsWriter(path)
    raise KernelError(_SAVE, f"{os.fspath(path)!r}: the file must end in .npz or .safetensors",
                      Status.INVALID_INPUT)
