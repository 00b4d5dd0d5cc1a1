"""Reading DCP's ``.metadata`` without running code from the checkpoint.

DCP stores its metadata as a pickle, and a pickle can name any importable callable to run on
load. vfsdp reads it with an unpickler that resolves only the classes a DCP metadata file is
made of (the ``torch.distributed.checkpoint.metadata`` types, ``_StorageInfo``, ``torch.Size``,
dtypes, layouts, paths) and refuses every other name, so a crafted ``.metadata`` is an error,
never code.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta

from vfsdp.checkpoint.storage import METADATA, CheckpointError

__all__ = ["SafeReader", "ALLOWED"]

ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "TensorProperties", "StorageMeta", "ChunkStorageMetadata",
        "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if name in ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(f"{self.where} refers to {module}.{name}, which a DCP metadata "
                              f"file never holds; refusing to load it (the file was crafted or "
                              f"written by another tool)")


class SafeReader(FileSystemReader):
    """A DCP ``FileSystemReader`` that unpickles the checkpoint's one ``.metadata`` with only
    the metadata classes allowed.

    Raises:
        CheckpointError: the file names anything else, or is not a pickle.
    """

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = os.path.join(str(self.path), METADATA)
        try:
            with open(path, "rb") as f:
                metadata = _Unpickler(f, path).load()
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - any unpickling failure is a corrupt file
            raise CheckpointError(f"{path} is not a readable DCP metadata file ({exc})") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
