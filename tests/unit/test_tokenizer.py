"""The offline WordPiece tokenizer reads the vocabulary it is given (transformers 5's BertTokenizerFast(vocab_file=)
silently did not, mapping every word to [UNK]), and the hashing tokenizer is a pure function of the text."""

import pytest

from dtlab.rank.data import HashingTokenizer, word_id, wordpiece_tokenizer

VOCAB = ["[PAD]", "[unused0]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "film", "is", "dull", "warm", "##s"]


def test_wordpiece_tokenizer_holds_every_line_and_maps_words_to_their_lines(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(VOCAB) + "\n")
    tok = wordpiece_tokenizer(str(path))
    assert len(tok) == len(VOCAB)
    ids = tok("The film is dull films")["input_ids"]
    assert ids == [VOCAB.index(w) for w in ("[CLS]", "the", "film", "is", "dull", "film", "##s", "[SEP]")]
    assert VOCAB.index("[UNK]") not in ids


def test_a_vocabulary_the_tokenizer_did_not_read_is_refused(tmp_path, monkeypatch):
    import transformers

    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(VOCAB) + "\n")
    # what transformers 5 did with BertTokenizerFast(vocab_file=...): a tokenizer of the 5 special tokens only
    monkeypatch.setattr(
        transformers.BertTokenizerFast, "from_pretrained", classmethod(lambda cls, *a, **k: cls(vocab_file=str(path)))
    )
    with pytest.raises(RuntimeError, match="did not read the vocabulary"):
        wordpiece_tokenizer(str(path))


def test_hashing_tokenizer_is_a_pure_function_of_the_text():
    enc = HashingTokenizer()(["a warm film", "A  warm   FILM"], max_length=8)
    assert enc["input_ids"][0].tolist() == enc["input_ids"][1].tolist()
    assert enc["input_ids"][0].tolist()[:5] == [101, word_id("a"), word_id("warm"), word_id("film"), 102]
    assert (
        word_id("film")
        == 1000 + int.from_bytes(__import__("hashlib").blake2b(b"film", digest_size=8).digest(), "little") % 29000
    )
