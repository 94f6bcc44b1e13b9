"""Tests for k3jax.data and tools/make_token_file.py."""
import json
import os
import re
import subprocess
import sys

from absl import flags
import ml_collections
import numpy as np
import pytest

from k3jax import data
from tools import make_token_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(source="default", paths=(), num_docs=200, num_workers=0):
  return ml_collections.ConfigDict(dict(source=source, paths=paths, default_num_docs=num_docs,
                                        num_workers=num_workers))


def _id_docs(n, max_len, seed=0):
  """Document k is (k + 1) repeated; adjacent documents are always distinguishable."""
  lengths = np.random.default_rng(seed).integers(1, max_len + 1, size=n)
  return [np.full(int(l), k + 1, dtype=np.int32) for k, l in enumerate(lengths)]


def _row_stream(batches):
  """The packed token rows [T + 1] of the batches, concatenated."""
  return np.concatenate([np.concatenate([b["inputs"][i], b["targets"][i, -1:]])
                         for b in batches for i in range(b["inputs"].shape[0])])


def _runs(stream):
  """Run-length decoding: [(value, length), ...]."""
  change = np.flatnonzero(np.diff(stream)) + 1
  starts = np.concatenate([[0], change])
  ends = np.concatenate([change, [stream.size]])
  return [(int(stream[s]), int(e - s)) for s, e in zip(starts, ends)]


def test_default_corpus_is_deterministic_and_structured():
  a, b, c = data.DefaultCorpus(300), data.DefaultCorpus(300), data.DefaultCorpus(300, seed=1)
  assert all(np.array_equal(a[i], b[i]) for i in range(300))
  assert not all(np.array_equal(a[i], c[i]) for i in range(20))
  kinds, facts = set(), 0
  for i in range(300):
    doc = a[i]
    assert doc.dtype == np.int32 and doc[0] == data.BOS and doc[-1] == data.EOS
    assert 50 + 2 <= doc.size <= 2000 + 2 and doc[1:-1].max() < 256
    text = data.decode_bytes(doc)
    assert text == data.default_document(0, i)
    kinds.add(text.split("\n", 1)[0])
    for x, op, y, z in re.findall(r"^(\d+) ([-+*]) (\d+) = (\d+)\.$", text, flags=re.M):
      facts += 1
      assert {"+": int(x) + int(y), "-": int(x) - int(y), "*": int(x) * int(y)}[op] == int(z)
    for line in re.findall(r"^sorted: (.*)\.$", text, flags=re.M):
      assert line.split() == sorted(line.split())
  assert kinds == {f"# {k}" for k in ("arithmetic", "counting", "records", "sorted", "repeat")}
  assert facts > 100


def test_packing_matches_an_independent_reconstruction(tmp_path):
  seq_len, batch, docs = 16, 4, _id_docs(40, max_len=45)
  path = make_token_file.write_memmap(docs, str(tmp_path / "ids"), "uint16")
  it = data.make_train_iterator(_cfg("memmap", str(tmp_path / "*.bin")), seq_len=seq_len,
                                batch_size=batch, vocab_size=100, seed=5)
  total = sum(d.size for d in docs)
  batches = [next(it) for _ in range(2 * total // (batch * (seq_len + 1)) + 2)]
  for b in batches:
    assert {k: (v.shape, v.dtype) for k, v in b.items()} == {
        "inputs": ((batch, seq_len), np.int32), "targets": ((batch, seq_len), np.int32),
        "segment_ids": ((batch, seq_len), np.int32), "positions": ((batch, seq_len), np.int32),
        "loss_mask": ((batch, seq_len), np.float32)}
    np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
    # Neighbouring documents always differ, so "same document" == "same token".
    np.testing.assert_array_equal(b["loss_mask"], (b["inputs"] == b["targets"]).astype(np.float32))
    for tok, seg, pos in zip(b["inputs"], b["segment_ids"], b["positions"]):
      new_doc = np.concatenate([[True], tok[1:] != tok[:-1]])
      np.testing.assert_array_equal(seg, np.cumsum(new_doc))
      run_start = np.maximum.accumulate(np.where(new_doc, np.arange(seq_len), 0))
      np.testing.assert_array_equal(pos, np.arange(seq_len) - run_start)
  # The rows, concatenated, are the documents in a shuffled order; the next epoch
  # holds every document again, in a different order.
  stream = _row_stream(batches)
  epochs = [_runs(stream[:total]), _runs(stream[total:2 * total])]
  for runs in epochs:
    assert sorted(runs) == sorted((k + 1, d.size) for k, d in enumerate(docs))
  assert epochs[0] != epochs[1]
  assert os.path.basename(path) == "ids.bin"


def test_shards_partition_the_documents(tmp_path):
  docs = _id_docs(30, max_len=10)
  make_token_file.write_memmap(docs, str(tmp_path / "ids"))
  seen = []
  for shard in range(3):
    it = data.make_train_iterator(_cfg("memmap", [str(tmp_path / "ids.bin")]), seq_len=8,
                                  batch_size=2, vocab_size=64, seed=0, shard_index=shard,
                                  shard_count=3)
    mine = [d for k, d in enumerate(docs) if k % 3 == shard]
    total = sum(d.size for d in mine)
    stream = _row_stream([next(it) for _ in range(total // 18 + 1)])[:total]
    assert sorted(_runs(stream)) == sorted((int(d[0]), d.size) for d in mine)
    seen += [v for v, _ in _runs(stream)]
  assert sorted(seen) == list(range(1, 31))


def test_memmap_and_array_record_round_trip(tmp_path):
  texts = ["first document, short.", "второй документ: utf-8 bytes", "x" * 300, "fourth\nline"]
  (tmp_path / "a.txt").write_text("\n\n".join(texts[:2]), encoding="utf-8")
  (tmp_path / "b.txt").write_text("\n\n".join(texts[2:]) + "\n\n", encoding="utf-8")
  inputs = [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]
  assert list(make_token_file.text_documents(inputs, "\n\n")) == texts
  encoded = [data.encode_bytes(t) for t in texts]
  make_token_file.write_memmap(encoded, str(tmp_path / "mm" / "train"), "uint32")
  make_token_file.write_array_record(encoded, str(tmp_path / "ar" / "train"))
  with open(tmp_path / "mm" / "train.json") as f:
    assert json.load(f) == {"dtype": "uint32", "num_tokens": sum(e.size for e in encoded),
                            "max_token_id": max(int(e.max()) for e in encoded)}
  cfgs = [_cfg("memmap", str(tmp_path / "mm" / "*")),
          _cfg("array_record", [str(tmp_path / "ar" / "train.array_record")])]
  for cfg in cfgs:
    src = data.make_source(cfg, vocab_size=data.BYTE_VOCAB_SIZE)
    assert len(src) == len(texts)
    for i, text in enumerate(texts):
      np.testing.assert_array_equal(src[i], encoded[i])
      assert data.decode_bytes(src[i]) == text
  its = [data.make_train_iterator(c, seq_len=32, batch_size=2, vocab_size=300, seed=9)
         for c in cfgs]
  for _ in range(4):
    x, y = next(its[0]), next(its[1])
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])


def test_command_line_tool(tmp_path):
  (tmp_path / "in.txt").write_text("alpha\n---\nbeta gamma\n")
  out = subprocess.run(
      [sys.executable, "-m", "tools.make_token_file", f"--input={tmp_path / 'in.txt'}",
       f"--output={tmp_path / 'tok'}", "--format=memmap", "--separator=\\n---\\n"],
      cwd=ROOT, capture_output=True, text=True, check=True)
  assert "tok.bin" in out.stdout
  src = data.TokenFileSource([data.MemmapTokenFile(str(tmp_path / "tok.bin"))], 258)
  assert [data.decode_bytes(src[i]) for i in range(len(src))] == ["alpha", "beta gamma\n"]


def test_out_of_vocab_token_names_file_and_position(tmp_path):
  docs = _id_docs(5, max_len=8)
  docs[3] = np.array([1, 2, 3, 4, 5, 300, 7], dtype=np.int32)
  make_token_file.write_memmap(docs, str(tmp_path / "bad"))
  with pytest.raises(data.DataError, match=r"bad\.bin.*largest token id is 300.*bad\.json.*"
                                           r"vocab_size=258"):
    data.make_source(_cfg("memmap", str(tmp_path / "bad.bin")), vocab_size=258)
  # A file written without max_token_id is checked document by document.
  meta = json.loads((tmp_path / "bad.json").read_text())
  del meta["max_token_id"]
  (tmp_path / "bad.json").write_text(json.dumps(meta))
  src = data.make_source(_cfg("memmap", str(tmp_path / "bad.bin")), vocab_size=258)
  for i in (0, 1, 2, 4):
    src[i]  # pylint: disable=pointless-statement
  offset = sum(d.size for d in docs[:3]) + 5
  with pytest.raises(ValueError, match=rf"bad\.bin.*token id 300 at document 3, offset 5, "
                                       rf"token {offset} of the file.*vocab_size=258"):
    src[3]  # pylint: disable=pointless-statement
  make_token_file.write_array_record(
      [np.arange(4), np.array([0, 1, -1], np.int32)], str(tmp_path / "neg"))
  it = data.make_train_iterator(_cfg("array_record", str(tmp_path / "neg.array_record")),
                                seq_len=8, batch_size=1, vocab_size=258, seed=0)
  with pytest.raises(ValueError, match=r"neg\.array_record.*token id -1 at document 1, offset 2"):
    next(it)


def test_invalid_config_and_malformed_files(tmp_path):
  kw = dict(seq_len=8, batch_size=1, vocab_size=300, seed=0)
  with pytest.raises(ValueError, match=r"data\.source.*'tfrecord'.*'default', 'memmap', "
                                       r"'array_record'"):
    data.make_train_iterator(_cfg("tfrecord"), **kw)
  with pytest.raises(ValueError, match=r"data\.paths.*nothing\*\.bin.*matches no files"):
    data.make_train_iterator(_cfg("memmap", str(tmp_path / "nothing*.bin")), **kw)
  with pytest.raises(ValueError, match=r"vocab_size=100.*>= 258"):
    data.make_train_iterator(_cfg(), **{**kw, "vocab_size": 100})
  with pytest.raises(ValueError, match=r"shard_index"):
    data.make_train_iterator(_cfg(), **kw, shard_index=2, shard_count=2)
  name = str(tmp_path / "m")
  make_token_file.write_memmap(_id_docs(4, 5), name)
  with open(name + ".bin", "ab") as f:
    f.write(b"\0\0")
  with pytest.raises(ValueError, match=r"m\.bin.*does not match num_tokens"):
    data.MemmapTokenFile(name + ".bin")
  make_token_file.write_memmap(_id_docs(4, 5), name)
  np.save(name + ".idx.npy", np.array([0, 3, 2, 5], dtype=np.int64))
  with pytest.raises(ValueError, match=r"m\.idx\.npy.*strictly increasing.*entry 1"):
    data.MemmapTokenFile(name + ".bin")
  os.remove(name + ".json")
  with pytest.raises(ValueError, match=r"m\.bin.*missing companion file.*m\.json"):
    data.MemmapTokenFile(name + ".bin")


@pytest.mark.parametrize("num_workers,starts", [(0, (0, 3, 4)), (1, (3,))])
def test_iterator_state_resumes_exactly(num_workers, starts):
  flags.FLAGS.mark_as_parsed()  # grain's worker processes read absl flags.
  cfg = _cfg(num_docs=100, num_workers=num_workers)

  def make():
    return data.make_train_iterator(cfg, seq_len=64, batch_size=2, vocab_size=300, seed=11)

  it = make()
  states, batches = [], []
  for _ in range(6):
    states.append(json.loads(json.dumps(it.get_state())))  # as grain's orbax handler does
    batches.append(next(it))
  it.close()
  for start in starts:
    resumed = make()
    resumed.set_state(states[start])
    for want in batches[start:start + 2]:
      got = next(resumed)
      for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    resumed.close()
