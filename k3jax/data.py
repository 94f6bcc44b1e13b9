"""Training data: a generated default corpus, pre-tokenized files, grain packing.

Documents are 1-D int32 token arrays. The pipeline (grain 0.2.18) is

  source -> shard by process -> shuffle (reseeded every epoch) -> repeat forever
  -> ConcatThenSplitIterDataset (rows of seq_len + 1 tokens, segment ids, positions)
  -> batch -> shift into inputs/targets with a loss mask [-> mp_prefetch workers].

Sources:
  * "default": `DefaultCorpus`, templated English-like documents generated from a
    fixed seed, byte-tokenized (token = byte, BOS = 256, EOS = 257).
  * "memmap": `NAME.bin` flat tokens (uint16/uint32, dtype and count in `NAME.json`)
    with `NAME.idx.npy` int64 document start offsets, read through np.memmap.
    `NAME.json` may hold `max_token_id` (written by tools/make_token_file.py): it is
    checked against the vocabulary before training; files without it are checked
    document by document as they are read.
  * "array_record": one document per record, little-endian int32 bytes.
Token files hold documents exactly as trained on (`tools/make_token_file.py` writes
BOS + bytes + EOS); the pipeline adds nothing, so any tokenizer's ids can be stored.
"""
from collections.abc import Sequence
import glob
import json
import os
from typing import Any

import grain
import ml_collections
import numpy as np

BOS = 256
EOS = 257
BYTE_VOCAB_SIZE = 258
DEFAULT_CORPUS_SEED = 0
SOURCES = ("default", "memmap", "array_record")
MEMMAP_DTYPES = ("uint16", "uint32")


class DataError(ValueError):
  """Training data that cannot be used as configured; the message names the file or field."""


# --------------------------------------------------------------------------- tokenizer


def encode_bytes(text: str) -> np.ndarray:
  """Byte tokenizer: [BOS, utf-8 bytes..., EOS] as int32 [L + 2]."""
  body = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)
  return np.concatenate([[BOS], body, [EOS]]).astype(np.int32)


def decode_bytes(tokens: Sequence[int] | np.ndarray) -> str:
  """Inverse of `encode_bytes`; BOS/EOS and ids >= 256 are dropped."""
  t = np.asarray(tokens)
  return bytes(t[(t >= 0) & (t < 256)].astype(np.uint8)).decode("utf-8", errors="replace")


# --------------------------------------------------------------------- default corpus

_WORDS = (
    "apple", "river", "stone", "cloud", "green", "happy", "light", "music", "north", "ocean",
    "paper", "quiet", "robin", "sugar", "table", "under", "voice", "water", "yellow", "zebra",
    "amber", "bread", "candle", "dance", "eagle", "forest", "garden", "harbor", "island",
    "jacket", "kettle", "lemon", "mirror", "night", "orange", "pepper", "rabbit", "silver",
    "tiger", "violet", "window", "winter", "summer", "morning", "evening", "little", "bright",
    "gentle", "travel", "wonder", "basket", "copper", "desert", "meadow", "planet", "rocket",
)
_NAMES = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy")
_CITIES = ("paris", "tokyo", "lima", "oslo", "cairo", "delhi", "rome", "quito", "seoul", "perth")
_COLORS = ("red", "blue", "green", "black", "white", "gray", "pink", "brown")
_NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                 "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
                 "seventeen", "eighteen", "nineteen", "twenty")
_MIN_DOC_BYTES = 50
_MAX_DOC_BYTES = 2000


def _arithmetic_line(rng: np.random.Generator) -> str:
  a, b = (int(x) for x in rng.integers(0, 100, size=2))
  op = int(rng.integers(3))
  if op == 0:
    return f"{a} + {b} = {a + b}.\n"
  if op == 1:
    return f"{max(a, b)} - {min(a, b)} = {max(a, b) - min(a, b)}.\n"
  a, b = a % 13, b % 13
  return f"{a} * {b} = {a * b}.\n"


def _counting_line(rng: np.random.Generator) -> str:
  if rng.random() < 0.3:
    start = int(rng.integers(0, 10))
    return " ".join(_NUMBER_WORDS[start:start + 8 + int(rng.integers(4))]) + ".\n"
  start, step, n = int(rng.integers(0, 500)), int(rng.integers(1, 6)), int(rng.integers(5, 12))
  return f"count by {step} from {start}: " + ", ".join(
      str(start + step * i) for i in range(n)) + ".\n"


def _record_line(rng: np.random.Generator) -> str:
  name = _NAMES[int(rng.integers(len(_NAMES)))]
  return (f"name: {name}\nage: {int(rng.integers(18, 90))}\n"
          f"city: {_CITIES[int(rng.integers(len(_CITIES)))]}\n"
          f"color: {_COLORS[int(rng.integers(len(_COLORS)))]}\n\n")


def _sorted_line(rng: np.random.Generator) -> str:
  words = rng.choice(len(_WORDS), size=int(rng.integers(4, 10)), replace=False)
  return "sorted: " + " ".join(sorted(_WORDS[int(i)] for i in words)) + ".\n"


def _phrase_generator(rng: np.random.Generator):
  phrase = " ".join(_WORDS[int(i)] for i in rng.choice(len(_WORDS), size=int(rng.integers(2, 6))))
  return lambda _: f"the {phrase}. "


_KINDS = ("arithmetic", "counting", "records", "sorted", "repeat")


def default_document(seed: int, index: int) -> str:
  """Text of document `index` of the default corpus: a deterministic function of both.

  One of five templates (arithmetic facts, counting, key: value records, sorted
  word lists, a repeated phrase) under a title line; log-uniform length in
  [50, 2000] bytes, cut at a line boundary.
  """
  rng = np.random.default_rng([seed, index])
  kind = _KINDS[int(rng.integers(len(_KINDS)))]
  line = {"arithmetic": _arithmetic_line, "counting": _counting_line,
          "records": _record_line, "sorted": _sorted_line,
          "repeat": _phrase_generator(rng)}[kind]
  target = int(np.exp(rng.uniform(np.log(_MIN_DOC_BYTES), np.log(_MAX_DOC_BYTES))))
  parts, size = [f"# {kind}\n"], len(kind) + 3
  while size < target:
    nxt = line(rng)
    if size + len(nxt) > _MAX_DOC_BYTES:
      break
    parts.append(nxt)
    size += len(nxt)
  return "".join(parts)


class DefaultCorpus:
  """grain RandomAccessDataSource of `num_docs` generated, byte-tokenized documents.

  Documents are generated on access (no storage); document i is
  `encode_bytes(default_document(seed, i))`.
  """

  def __init__(self, num_docs: int, seed: int = DEFAULT_CORPUS_SEED):
    if num_docs <= 0:
      raise DataError(f"config field `data.default_num_docs`: must be positive, got {num_docs}")
    self.num_docs = num_docs
    self.seed = seed

  def __len__(self) -> int:
    return self.num_docs

  def __getitem__(self, index: int) -> np.ndarray:
    return encode_bytes(default_document(self.seed, int(index)))

  def __repr__(self) -> str:
    return f"DefaultCorpus(num_docs={self.num_docs}, seed={self.seed})"


# --------------------------------------------------------------------- token files


class MemmapTokenFile:
  """One `NAME.bin` + `NAME.json` + `NAME.idx.npy` triple; documents are np.memmap views.

  The sidecar and index are validated on construction; the token memmap is opened
  lazily in each process (it is not pickled to grain workers).
  """

  def __init__(self, bin_path: str):
    if not bin_path.endswith(".bin"):
      raise DataError(f"memmap token file {bin_path!r}: expected a NAME.bin path")
    self.path = bin_path
    stem = bin_path[:-len(".bin")]
    meta_path, idx_path = stem + ".json", stem + ".idx.npy"
    for p in (meta_path, idx_path):
      if not os.path.exists(p):
        raise DataError(f"memmap token file {bin_path!r}: missing companion file {p!r}")
    try:
      with open(meta_path) as f:
        meta = json.load(f)
      dtype, num_tokens = meta["dtype"], meta["num_tokens"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
      raise DataError(f"{meta_path!r}: expected JSON {{\"dtype\": ..., \"num_tokens\": ...}} "
                       f"({type(e).__name__}: {e})") from e
    if dtype not in MEMMAP_DTYPES:
      raise DataError(f"{meta_path!r}: dtype {dtype!r} not in {list(MEMMAP_DTYPES)}")
    if not isinstance(num_tokens, int) or num_tokens <= 0:
      raise DataError(f"{meta_path!r}: num_tokens must be a positive integer, got {num_tokens!r}")
    max_id = meta.get("max_token_id")
    if max_id is not None and (not isinstance(max_id, int) or max_id < 0):
      raise DataError(f"{meta_path!r}: max_token_id must be a non-negative integer, got "
                      f"{max_id!r}")
    self.meta_path, self.max_token_id = meta_path, max_id
    self.dtype = np.dtype(dtype).newbyteorder("<")
    self.num_tokens = num_tokens
    size = os.path.getsize(bin_path)
    if size != num_tokens * self.dtype.itemsize:
      raise DataError(f"{bin_path!r}: size {size} bytes does not match num_tokens={num_tokens} "
                       f"x {self.dtype.itemsize} bytes ({dtype}) from {meta_path!r}")
    starts = np.load(idx_path)
    if starts.ndim != 1 or starts.dtype != np.int64 or starts.size == 0:
      raise DataError(f"{idx_path!r}: expected a non-empty 1-D int64 array of document start "
                       f"offsets, got shape {starts.shape} dtype {starts.dtype}")
    ends = np.append(starts[1:], num_tokens)
    bad = np.flatnonzero(ends <= starts)
    if starts[0] != 0 or bad.size:
      where = 0 if starts[0] != 0 else int(bad[0])
      raise DataError(f"{idx_path!r}: document start offsets must begin at 0, be strictly "
                       f"increasing and stay below num_tokens={num_tokens}; entry {where} = "
                       f"{int(starts[where])} breaks this")
    self.starts, self.ends = starts, ends
    self._tokens = None

  def __len__(self) -> int:
    return self.starts.size

  def __getstate__(self) -> dict[str, Any]:
    return {**self.__dict__, "_tokens": None}

  def read(self, doc: int) -> tuple[np.ndarray, int]:
    """Document `doc` (a zero-copy view) and its offset in the file."""
    if self._tokens is None:
      self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))
    start = int(self.starts[doc])
    return self._tokens[start:int(self.ends[doc])], start


class ArrayRecordTokenFile:
  """One ArrayRecord file; each record is one document of little-endian int32 tokens."""

  def __init__(self, path: str):
    self.path = path
    self._source = grain.sources.ArrayRecordDataSource([path])

  def __len__(self) -> int:
    return len(self._source)

  def read(self, doc: int) -> tuple[np.ndarray, None]:
    """Document `doc`; records are not offsets into a flat array, so no offset."""
    record = self._source[doc]
    if len(record) % 4:
      raise DataError(f"{self.path!r}: record (document) {doc} has {len(record)} bytes, "
                       "not a multiple of 4 (expected little-endian int32 tokens)")
    return np.frombuffer(record, dtype="<i4"), None


class TokenFileSource:
  """grain RandomAccessDataSource over the documents of several token files, in order.

  A memmap file whose `max_token_id` lies outside the vocabulary is refused here, before
  training. Every document is also checked as it is read: an id outside [0, vocab_size)
  raises a DataError naming the file, the document index in that file and the offset.
  """

  def __init__(self, files: Sequence[MemmapTokenFile | ArrayRecordTokenFile], vocab_size: int):
    self.files = list(files)
    self.vocab_size = vocab_size
    for f in self.files:
      max_id = getattr(f, "max_token_id", None)
      if max_id is not None and max_id >= vocab_size:
        raise DataError(f"{f.path!r}: its largest token id is {max_id} ({f.meta_path!r}), "
                        f"outside [0, model.vocab_size={vocab_size})")
    counts = np.array([len(f) for f in self.files], dtype=np.int64)
    self._first_doc = np.concatenate([[0], np.cumsum(counts)])

  def __len__(self) -> int:
    return int(self._first_doc[-1])

  def __getitem__(self, index: int) -> np.ndarray:
    index = int(index)
    if not 0 <= index < len(self):
      raise IndexError(f"document {index} out of range [0, {len(self)})")
    f = int(np.searchsorted(self._first_doc, index, side="right")) - 1
    doc = index - int(self._first_doc[f])
    tokens, file_offset = self.files[f].read(doc)
    bad = np.flatnonzero((tokens < 0) | (tokens >= self.vocab_size))
    if bad.size:
      off = int(bad[0])
      where = "" if file_offset is None else f", token {file_offset + off} of the file"
      raise DataError(f"{self.files[f].path!r}: token id {int(tokens[off])} at document {doc}, "
                       f"offset {off}{where} is outside [0, vocab_size={self.vocab_size})")
    return tokens.astype(np.int32)

  def __repr__(self) -> str:
    return f"TokenFileSource({len(self.files)} files, {len(self)} documents)"


def resolve_paths(paths: str | Sequence[str], field: str = "data.paths") -> list[str]:
  """Expands a glob string or a list of paths/globs into a sorted, de-duplicated list."""
  patterns = [paths] if isinstance(paths, str) else list(paths)
  if not patterns:
    raise DataError(f"config field `{field}`: empty; give a list of files or a glob string")
  out: list[str] = []
  for p in patterns:
    matches = sorted(glob.glob(os.path.expanduser(p)))
    if not matches:
      raise DataError(f"config field `{field}`: {p!r} matches no files")
    out.extend(m for m in matches if m not in out)
  return out


def make_source(data_cfg: ml_collections.ConfigDict, vocab_size: int):
  """The grain data source that `data_cfg` describes (see module docstring)."""
  source = data_cfg.source
  if source not in SOURCES:
    raise DataError(f"config field `data.source`: got {source!r}; allowed values: {list(SOURCES)}")
  if source == "default":
    if vocab_size < BYTE_VOCAB_SIZE:
      raise DataError(f"vocab_size={vocab_size} is too small for the byte tokenizer of the "
                       f"default corpus; need >= {BYTE_VOCAB_SIZE}")
    return DefaultCorpus(data_cfg.default_num_docs)
  paths = resolve_paths(data_cfg.paths)
  if source == "memmap":
    bins = [p for p in paths if p.endswith(".bin")]
    if not bins:
      raise DataError(f"config field `data.paths`: no NAME.bin files among {paths}")
    return TokenFileSource([MemmapTokenFile(p) for p in bins], vocab_size)
  return TokenFileSource([ArrayRecordTokenFile(p) for p in paths], vocab_size)


# --------------------------------------------------------------------------- packing


def _as_features(tokens: np.ndarray) -> dict[str, np.ndarray]:
  return {"tokens": tokens}


def shift_packed_batch(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Packed rows [B, T+1] -> model batch [B, T] (next-token prediction).

  loss_mask[b, t] = 1 iff targets[b, t] belongs to the same (non-padding)
  document as inputs[b, t].
  """
  tokens, seg = batch["tokens"], batch["tokens_segment_ids"]
  same_doc = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)
  return {
      "inputs": tokens[:, :-1].astype(np.int32),
      "targets": tokens[:, 1:].astype(np.int32),
      "segment_ids": seg[:, :-1].astype(np.int32),
      "positions": batch["tokens_positions"][:, :-1].astype(np.int32),
      "loss_mask": same_doc.astype(np.float32),
  }


def pack_documents(docs: grain.IterDataset, *, seq_len: int, batch_size: int) -> grain.IterDataset:
  """Concat-then-split packing of 1-D token documents into model batches.

  grain's ConcatThenSplitIterDataset concatenates documents and cuts rows of
  seq_len + 1 tokens; a document that does not fit continues in the next row
  (its positions restart at 0 there). It emits segment ids (1, 2, ... per row,
  0 = padding, which only a finite stream's last row has) and positions, which
  `shift_packed_batch` turns into the batch.
  """
  rows = grain.experimental.ConcatThenSplitIterDataset(
      docs.map(_as_features), length_struct={"tokens": seq_len + 1})
  return rows.batch(batch_size, drop_remainder=True).map(shift_packed_batch)


def _slices_as_tuples(state: Any) -> Any:
  """Undoes JSON's tuple -> list change on ConcatThenSplit `remainder_slices` entries."""
  if isinstance(state, dict):
    return {k: ({f: tuple(sl) for f, sl in v.items()} if k == "remainder_slices"
                else _slices_as_tuples(v)) for k, v in state.items()}
  if isinstance(state, list):
    return [_slices_as_tuples(v) for v in state]
  return state


class JsonStateIterator(grain.DatasetIterator):
  """Pass-through iterator whose `set_state` also accepts a JSON round-tripped state.

  grain 0.2.18's ConcatThenSplit iterator tests `slice != (-1, -1)` on its state;
  after JSON (grain's orbax handler) the empty slice is the list [-1, -1], so a
  restored iterator would wrongly read a remainder document. States are JSON
  serialisable as they are.
  """

  def __next__(self) -> dict[str, np.ndarray]:
    return next(self._parent)

  def get_state(self) -> dict[str, Any]:
    return self._parent.get_state()

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(_slices_as_tuples(state))


def make_train_iterator(data_cfg: ml_collections.ConfigDict, *, seq_len: int, batch_size: int,
                        vocab_size: int, seed: int, shard_index: int = 0,
                        shard_count: int = 1) -> JsonStateIterator:
  """Infinite iterator of packed batches for this process.

  Yields dicts of numpy arrays: inputs, targets, segment_ids, positions [B, T]
  int32 and loss_mask [B, T] float32, with B = batch_size (per process) and
  T = seq_len. Documents are split over `shard_count` processes (this one takes
  every shard_count-th document from shard_index) and shuffled with `seed`,
  differently in every epoch. `get_state()` / `set_state()` restore the exact
  position. With data.num_workers > 0 (grain worker processes) absl flags must be
  parsed first, as absl.app.run does.
  """
  for name, value in (("seq_len", seq_len), ("batch_size", batch_size),
                      ("shard_count", shard_count)):
    if value <= 0:
      raise DataError(f"{name} must be positive, got {value}")
  if not 0 <= shard_index < shard_count:
    raise DataError(f"shard_index must lie in [0, shard_count={shard_count}), got {shard_index}")
  if not 0 <= seed < 2**32:
    raise DataError(f"seed must lie in [0, 2**32), got {seed}")
  if data_cfg.num_workers < 0:
    raise DataError(f"config field `data.num_workers`: must be >= 0, got {data_cfg.num_workers}")
  source = make_source(data_cfg, vocab_size)
  docs = grain.MapDataset.source(source)[shard_index::shard_count]
  if len(docs) == 0:
    raise DataError(f"shard {shard_index} of {shard_count} has no documents "
                     f"({len(source)} documents in the source)")
  docs = docs.shuffle(seed=seed).repeat(None).to_iter_dataset(
      grain.ReadOptions(num_threads=2, prefetch_buffer_size=64))
  ds = pack_documents(docs, seq_len=seq_len, batch_size=batch_size)
  if data_cfg.num_workers > 0:
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=data_cfg.num_workers))
  return JsonStateIterator(iter(ds))
