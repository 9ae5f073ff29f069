"""Malformed, newer-version and wrongly typed layout documents raise typed errors naming the field."""

from __future__ import annotations

import copy
import json

import pytest

from chunkzero import ChunkLayout, LayoutFormatError, LayoutVersionError, TensorSpec


def _doc() -> dict:
    specs = [TensorSpec("a", (3, 2)), TensorSpec("b", (5,), aliases=("b2",)), TensorSpec("c", (9,), "bfloat16")]
    return ChunkLayout.build(specs, 11, 2).to_dict()


def _set(path, value):
    def mutate(d):
        *head, last = path
        for k in head:
            d = d[k]
        d[last] = value
    return mutate


def _delete(path):
    def mutate(d):
        *head, last = path
        for k in head:
            d = d[k]
        del d[last]
    return mutate


MUTATIONS = [
    ("format", _set(["format"], "something.else"), LayoutFormatError),
    ("version", _set(["version"], 2), LayoutVersionError),
    ("version", _set(["version"], 0), LayoutVersionError),
    ("version", _set(["version"], "1"), LayoutFormatError),
    ("version", _delete(["version"]), LayoutFormatError),
    ("chunk_size", _delete(["chunk_size"]), LayoutFormatError),
    ("chunk_size", _set(["chunk_size"], 11.0), LayoutFormatError),
    ("chunk_size", _set(["chunk_size"], 0), LayoutFormatError),
    ("world_size", _set(["world_size"], True), LayoutFormatError),
    # chunk 1 (9 bf16 elements, size 10) is not a multiple of 3: the inconsistent field is named
    ("chunks[1].size", _set(["world_size"], 3), LayoutFormatError),
    ("tensors", _set(["tensors"], {"a": 1}), LayoutFormatError),
    ("tensors[0]", _set(["tensors", 0], "a"), LayoutFormatError),
    ("tensors[0].name", _delete(["tensors", 0, "name"]), LayoutFormatError),
    ("tensors[0].shape", _set(["tensors", 0, "shape"], [3, -2]), LayoutFormatError),
    ("tensors[0].shape", _set(["tensors", 0, "shape"], "3x2"), LayoutFormatError),
    ("tensors[1].aliases", _set(["tensors", 1, "aliases"], [7]), LayoutFormatError),
    ("tensors[2].dtype", _set(["tensors", 2, "dtype"], "complex64"), LayoutFormatError),
    ("tensors[1].chunk", _set(["tensors", 1, "chunk"], 9), LayoutFormatError),
    ("tensors[1].offset", _set(["tensors", 1, "offset"], 5), LayoutFormatError),
    ("tensors[1].requires_grad", _set(["tensors", 1, "requires_grad"], "yes"), LayoutFormatError),
    ("tensors[1].name", _set(["tensors", 1, "name"], "a"), LayoutFormatError),
    ("chunks", _delete(["chunks"]), LayoutFormatError),
    ("chunks[0].index", _set(["chunks", 0, "index"], 1), LayoutFormatError),
    ("chunks[0].utilized", _set(["chunks", 0, "utilized"], 10), LayoutFormatError),
    ("chunks[0].size", _set(["chunks", 0, "size"], 13), LayoutFormatError),
    ("chunks[0].size", _set(["chunks", 0, "size"], 4), LayoutFormatError),
    ("chunks[1].dtype", _set(["chunks", 1, "dtype"], "float32"), LayoutFormatError),
    ("chunks[0].keep_gathered", _delete(["chunks", 0, "keep_gathered"]), LayoutFormatError),
    ("chunks[0].requires_grad", _set(["chunks", 0, "requires_grad"], False), LayoutFormatError),
]


@pytest.mark.parametrize("field,mutate,error", MUTATIONS, ids=[f"{m[0]}-{i}" for i, m in enumerate(MUTATIONS)])
def test_bad_field_is_named(field, mutate, error):
    doc = copy.deepcopy(_doc())
    mutate(doc)
    with pytest.raises(error) as info:
        ChunkLayout.from_dict(doc)
    assert info.value.field == field, str(info.value)
    assert repr(field) in str(info.value)
    # the same through JSON text
    with pytest.raises(error):
        ChunkLayout.from_json(json.dumps(doc))


def test_newer_version_is_a_version_error():
    doc = _doc()
    doc["version"] = 99
    with pytest.raises(LayoutVersionError, match="99"):
        ChunkLayout.from_json(json.dumps(doc))
    assert issubclass(LayoutVersionError, LayoutFormatError)


@pytest.mark.parametrize("text", ["", "{", "not json", b"\xff\xfe"])
def test_not_json(text):
    with pytest.raises(LayoutFormatError) as info:
        ChunkLayout.from_json(text)
    assert info.value.field == "<document>"


@pytest.mark.parametrize("doc", [[], "layout", 3, None])
def test_not_an_object(doc):
    with pytest.raises(LayoutFormatError) as info:
        ChunkLayout.from_dict(doc)
    assert info.value.field == "<document>"


def test_valid_document_still_loads():
    assert ChunkLayout.from_dict(_doc()).to_dict() == _doc()
