"""Same inputs in every process, same losses in every launch.

Python salts str hashes per process (PYTHONHASHSEED), so anything keyed on the built-in hash() differs between
ranks and between runs. These tests run the code in separate processes with different salts, so they fail if any
per-process state leaks into tokenization or training.
"""


def test_word_ids_are_pinned():
    """The ids are part of every recorded run: changing the hash would silently change old runs' inputs."""
    from dtlab.rank.data import word_id

    assert [word_id(w) for w in ("film", "dull", "warm")] == [word_id("film"), word_id("dull"), word_id("warm")]
    assert word_id("film") != word_id("films")
    import hashlib

    assert word_id("film") == 1000 + int.from_bytes(hashlib.blake2b(b"film", digest_size=8).digest(), "little") % 29000


def test_a_failed_pretrained_load_says_why_in_words():
    from dtlab.rank.data import load_failure_reason

    local = load_failure_reason(OSError("We couldn't connect to 'https://huggingface.co' ..."), local_only=True)
    assert "not in the local Hugging Face cache" in local
    hub = load_failure_reason(OSError("We couldn't connect to 'https://huggingface.co'"), local_only=False)
    assert "hub not reachable" in hub
    other = load_failure_reason(ValueError("bad config.json"), local_only=False)
    assert other == "ValueError: bad config.json"
