r"""Writes pre-tokenized training files from text with the byte tokenizer.

Every document becomes [BOS, utf-8 bytes..., EOS] (k3jax.data.encode_bytes).

  python -m tools.make_token_file --input=a.txt,b.txt --output=data/train \
      --format=memmap [--separator='\n\n']

--format=memmap writes data/train.bin, data/train.json ({"dtype", "num_tokens",
"max_token_id"}) and data/train.idx.npy (train with data.source="memmap",
data.paths="data/*.bin"); --format=array_record
writes data/train.array_record, one int32 little-endian record per document
(data.source="array_record", data.paths="data/*.array_record").
An input file with no document is skipped with a warning; if none has one, nothing is
written. Files appear under their final names only once complete.
"""
from collections.abc import Iterable, Iterator, Sequence
import json
import os

from absl import flags
from absl import logging
from array_record.python import array_record_module
import numpy as np

from k3jax import data
from launch import cli

_INPUT = flags.DEFINE_list("input", None, "Text files (comma-separated).")
_OUTPUT = flags.DEFINE_string("output", None, "Output NAME (suffixes are added).")
_FORMAT = flags.DEFINE_enum("format", "memmap", ["memmap", "array_record"], "Output format.")
_DTYPE = flags.DEFINE_enum("dtype", "uint16", list(data.MEMMAP_DTYPES), "memmap token dtype.")
_SEPARATOR = flags.DEFINE_string(
    "separator", "", "Splits each file into documents (escapes such as \\n are decoded); "
    "empty: one document per file. Empty documents are skipped.")


def text_documents(paths: Sequence[str], separator: str = "") -> Iterator[str]:
  """The documents of the text files: whole files, or pieces between `separator`.

  Empty documents are dropped; a file with none is skipped with a warning. Raises
  DataError naming the files if none of them holds a document.
  """
  count = 0
  for path in paths:
    try:
      with open(path, encoding="utf-8") as f:
        text = f.read()
    except UnicodeDecodeError as e:
      raise data.DataError(f"{path!r}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    except OSError as e:
      raise data.DataError(f"{path!r}: cannot be read ({e.strerror})") from e
    docs = [doc for doc in (text.split(separator) if separator else [text]) if doc]
    if not docs:
      logging.warning("skipped %r: it holds no document (%s)", path,
                      "empty file" if not text else f"only separators {separator!r}")
    count += len(docs)
    yield from docs
  if not count:
    raise data.DataError(f"no documents to write: every input file is empty ({list(paths)})")


def _publish(tmp_paths: dict[str, str]) -> None:
  """Renames each finished temporary file to its final name (the order of the dict)."""
  for final, tmp in tmp_paths.items():
    os.replace(tmp, final)


def _discard(tmp_paths: dict[str, str]) -> None:
  for tmp in tmp_paths.values():
    if os.path.exists(tmp):
      os.remove(tmp)


def write_memmap(docs: Iterable[np.ndarray], output: str, dtype: str = "uint16") -> str:
  """Writes NAME.bin, NAME.idx.npy, then NAME.json; returns the NAME.bin path."""
  if dtype not in data.MEMMAP_DTYPES:
    raise ValueError(f"dtype must be one of {list(data.MEMMAP_DTYPES)}, got {dtype!r}")
  np_dtype = np.dtype(dtype).newbyteorder("<")
  limit = np.iinfo(np_dtype).max
  starts, num_tokens, max_id = [], 0, 0
  os.makedirs(os.path.dirname(output) or ".", exist_ok=True)
  tmp = {output + suffix: f"{output}{suffix}.tmp-{os.getpid()}"
         for suffix in (".bin", ".idx.npy", ".json")}
  try:
    with open(tmp[output + ".bin"], "wb") as f:
      for i, doc in enumerate(docs):
        doc = np.asarray(doc)
        if doc.size == 0:
          raise data.DataError(f"document {i} is empty")
        if doc.min() < 0 or doc.max() > limit:
          raise data.DataError(f"document {i} has token ids outside [0, {limit}] of dtype {dtype}")
        starts.append(num_tokens)
        f.write(doc.astype(np_dtype).tobytes())
        num_tokens += doc.size
        max_id = max(max_id, int(doc.max()))
    if not starts:
      raise data.DataError("no documents to write")
    with open(tmp[output + ".idx.npy"], "wb") as f:
      np.save(f, np.asarray(starts, dtype=np.int64))
    with open(tmp[output + ".json"], "w") as f:
      json.dump({"dtype": dtype, "num_tokens": num_tokens, "max_token_id": max_id}, f)
    _publish(tmp)
  finally:
    _discard(tmp)
  return output + ".bin"


def write_array_record(docs: Iterable[np.ndarray], output: str) -> str:
  """Writes NAME.array_record (one int32 LE record per document); returns its path."""
  path = output + ".array_record"
  os.makedirs(os.path.dirname(output) or ".", exist_ok=True)
  tmp = {path: f"{path}.tmp-{os.getpid()}"}
  try:
    writer = array_record_module.ArrayRecordWriter(tmp[path], "group_size:1")
    count = 0
    try:
      for doc in docs:
        writer.write(np.asarray(doc).astype("<i4").tobytes())
        count += 1
    finally:
      writer.close()
    if not count:
      raise data.DataError("no documents to write")
    _publish(tmp)
  finally:
    _discard(tmp)
  return path


def main(argv: Sequence[str]) -> None:
  del argv
  docs = (data.encode_bytes(t) for t in text_documents(
      _INPUT.value, _SEPARATOR.value.encode("utf-8").decode("unicode_escape")))
  if _FORMAT.value == "memmap":
    path = write_memmap(docs, _OUTPUT.value, _DTYPE.value)
  else:
    path = write_array_record(docs, _OUTPUT.value)
  print(f"wrote {path}")


if __name__ == "__main__":
  flags.mark_flags_as_required(["input", "output"])
  cli.run(main)
