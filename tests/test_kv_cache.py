"""Pure bookkeeping of the prefix KV cache and of incremental detokenization (no model)."""

from __future__ import annotations

import pytest

from daskllm.engines.detok import TextStream
from daskllm.engines.kv_cache import ROOT_HASH, BlockManager, block_hashes, hash_block

BS = 4


def _tokens(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def _fill(bm: BlockManager, token_ids: list[int]) -> list[int]:
    """Allocate and register blocks for the full blocks of ``token_ids``, as the engine does."""
    n = len(token_ids) // bm.block_size
    ids = bm.allocate(n)
    assert ids is not None
    parent = ROOT_HASH
    for i, block_id in enumerate(ids):
        parent, ids[i] = bm.register(block_id, parent, token_ids[i * bm.block_size:(i + 1) * bm.block_size])
    return ids


# --- block_hashes -----------------------------------------------------------------------


def test_block_hashes_cover_full_blocks_only_and_chain():
    ids = _tokens(11)
    hashes = block_hashes(ids, BS)
    assert len(hashes) == 2  # the partial third block is not hashed
    assert hashes[0] == hash_block(ROOT_HASH, ids[0:4])
    assert hashes[1] == hash_block(hashes[0], ids[4:8])
    assert block_hashes(ids, BS, limit=7) == hashes[:1]
    assert block_hashes(ids, BS, limit=8) == hashes
    assert block_hashes(ids[:3], BS) == []
    # deterministic, and independent of the container type
    assert block_hashes(tuple(ids), BS) == hashes


def test_chain_hash_depends_on_every_previous_block():
    common = [7, 7, 7, 7]
    a = [1, 2, 3, 4] + [5, 6, 7, 8] + common
    b = [1, 2, 3, 9] + [5, 6, 7, 8] + common  # differs only in the first block
    c = [1, 2, 3, 4] + [5, 6, 7, 9] + common  # differs only in the middle block
    ha, hb, hc = block_hashes(a, BS), block_hashes(b, BS), block_hashes(c, BS)
    assert ha[0] == hc[0] and ha[0] != hb[0]
    # the same last block after a different prefix gets a different hash
    assert len({ha[2], hb[2], hc[2]}) == 3
    assert ha[1] != hb[1]
    # a block's hash is not just a function of its own tokens
    assert block_hashes(common, BS)[0] not in (ha[2], hb[2], hc[2])
    # order within a block matters
    assert block_hashes([4, 3, 2, 1], BS) != block_hashes([1, 2, 3, 4], BS)


# --- match_prefix ---------------------------------------------------------------------------


def test_match_prefix_returns_longest_resident_chain():
    bm = BlockManager(8, BS)
    ids = _tokens(12)
    table = _fill(bm, ids)
    bm.release(table)
    assert bm.num_used == 0

    got = bm.match_prefix(ids, len(ids))
    assert got == table
    assert [bm.blocks[b].ref_count for b in got] == [1, 1, 1]
    assert bm.num_used == 3
    bm.release(got)

    # limit cuts the chain to the full blocks below it
    got = bm.match_prefix(ids, 11)
    assert got == table[:2]
    bm.release(got)
    assert bm.match_prefix(ids, 3) == []

    # a longer prompt with the same start matches the resident part
    got = bm.match_prefix(ids + _tokens(8, 900), 20)
    assert got == table
    bm.release(got)


def test_match_prefix_stops_at_first_miss():
    bm = BlockManager(8, BS)
    ids = _tokens(12)
    table = _fill(bm, ids)
    bm.release(table)
    # the second block differs: the third block's tokens are resident, but chained after the
    # original second block, so it must not match
    other = ids[:4] + [1, 1, 1, 1] + ids[8:12]
    got = bm.match_prefix(other, len(other))
    assert got == table[:1]
    bm.release(got)
    # a miss in the first block matches nothing, even if later blocks' tokens are resident
    assert bm.match_prefix([0, 0, 0, 0] + ids[4:], 12) == []
    assert bm.num_used == 0


def test_match_prefix_stops_at_evicted_block():
    bm = BlockManager(3, BS)
    ids = _tokens(12)
    table = _fill(bm, ids)
    bm.release(table)  # evictable order: tail first -> table[2], table[1], table[0]
    one = bm.allocate(1)
    assert one == [table[2]]  # the tail went first
    assert bm.match_prefix(ids, 12) == table[:2]


# --- reference counts and eviction ----------------------------------------------------------


def test_referenced_blocks_are_never_evicted():
    bm = BlockManager(4, BS)
    a = _tokens(8)
    table = _fill(bm, a)  # held, ref_count 1
    other = _fill(bm, _tokens(8, 500))
    bm.release(other)
    assert bm.num_free == 2
    assert bm.allocate(3) is None  # would need one of the held blocks
    new = bm.allocate(2)
    assert sorted(new) == sorted(other)
    assert not set(new) & set(table)
    assert bm.evicted_blocks == 2
    assert bm.allocate(1) is None
    # the held prefix is still resident and matchable
    assert set(block_hashes(a, BS)) <= bm.resident_hashes()
    got = bm.match_prefix(a, 8)
    assert got == table
    assert [bm.blocks[b].ref_count for b in table] == [2, 2]


def test_shared_block_survives_one_release():
    bm = BlockManager(2, BS)
    ids = _tokens(4)
    table = _fill(bm, ids)
    again = bm.match_prefix(ids, 4)  # a second sequence shares the block
    assert again == table
    bm.release(table)  # first sequence done; the second still holds it
    assert bm.blocks[table[0]].ref_count == 1
    assert bm.allocate(2) is None
    assert bm.allocate(1) is not None
    assert bm.evicted_blocks == 0
    assert bm.match_prefix(ids, 4) == table


def test_allocate_returns_none_when_too_few_free_and_changes_nothing():
    bm = BlockManager(4, BS)
    table = _fill(bm, _tokens(8))
    bm.release(table)
    held = bm.allocate(1)
    assert held is not None
    before = (bm.num_free, bm.evicted_blocks, bm.resident_hashes())
    assert bm.allocate(4) is None
    assert (bm.num_free, bm.evicted_blocks, bm.resident_hashes()) == before
    assert bm.allocate(3) is not None
    assert bm.num_free == 0
    assert bm.allocate(1) is None


def test_empty_blocks_are_used_before_evicting_cached_ones():
    bm = BlockManager(4, BS)
    table = _fill(bm, _tokens(8))
    bm.release(table)
    new = bm.allocate(2)
    assert not set(new) & set(table)
    assert bm.evicted_blocks == 0
    assert bm.match_prefix(_tokens(8), 8) == table


def test_lru_evicts_least_recently_released_sequence_first():
    bm = BlockManager(6, BS)
    a, b = _tokens(12, 100), _tokens(12, 200)
    ta, tb = _fill(bm, a), _fill(bm, b)
    bm.release(ta)
    bm.release(tb)
    assert bm.num_used == 0 and bm.evicted_blocks == 0

    # A was released first: its blocks go first, tail before head
    assert bm.allocate(1) == [ta[2]]
    assert bm.evicted_blocks == 1
    assert bm.match_prefix(a, 12) == ta[:2]  # re-acquired: no longer evictable
    bm.release(ta[:2])  # released again: now the most recent
    assert bm.allocate(3) == [tb[2], tb[1], tb[0]]
    assert bm.evicted_blocks == 4
    assert bm.match_prefix(b, 12) == []
    assert bm.allocate(2) == [ta[1], ta[0]]
    assert bm.evicted_blocks == 6
    assert bm.resident_hashes() == frozenset()


def test_evicted_hashes_leave_resident_set():
    bm = BlockManager(2, BS)
    a = _tokens(8)
    table = _fill(bm, a)
    assert bm.resident_hashes() == frozenset(block_hashes(a, BS))
    bm.release(table)
    assert bm.resident_hashes() == frozenset(block_hashes(a, BS))  # released but still cached
    bm.allocate(1)
    assert bm.resident_hashes() == frozenset(block_hashes(a, BS)[:1])
    assert bm.evicted_blocks == 1


def test_duplicate_registration_switches_to_the_cached_copy():
    bm = BlockManager(4, BS)
    ids = _tokens(4)
    [first] = bm.allocate(1)
    [second] = bm.allocate(1)
    h1, kept1 = bm.register(first, ROOT_HASH, ids)
    h2, kept2 = bm.register(second, ROOT_HASH, ids)
    assert h1 == h2 == block_hashes(ids, BS)[0]
    assert kept1 == kept2 == first  # the second user now shares the first copy
    assert bm.hash_to_block[h1] == first
    assert bm.num_used == 1  # the duplicate went straight back to the free list
    bm.release([kept2])
    assert h1 in bm.resident_hashes() and bm.num_used == 1  # still held by its first user
    bm.release([kept1])
    # the duplicate was dropped as an empty block: reusing it evicts nothing
    assert bm.match_prefix(ids, 4) == [first]
    assert bm.allocate(3) is not None
    assert bm.evicted_blocks == 0
    assert h1 in bm.resident_hashes()


def test_a_shared_parent_is_never_evicted_before_its_children():
    """Two sequences compute the same first block, then diverge: every chain stays whole."""
    bm = BlockManager(6, BS)
    head, tail_a, tail_b = _tokens(4), _tokens(4, start=300), _tokens(4, start=200)
    seq_a = _fill(bm, head + tail_a)
    seq_b = _fill(bm, head + tail_b)
    assert seq_a[0] == seq_b[0]
    bm.release(seq_a)
    bm.release(seq_b)
    for _ in range(bm.num_blocks):  # evict one block at a time, oldest first
        bm.allocate(1)
        resident = bm.resident_hashes()
        for chain in (block_hashes(head + tail_a, BS), block_hashes(head + tail_b, BS)):
            assert not (chain[1] in resident and chain[0] not in resident)


def test_block_manager_rejects_bad_sizes():
    with pytest.raises(ValueError):
        BlockManager(0, 4)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


# --- TextStream -----------------------------------------------------------------------------


def _byte_decoder(vocab: dict[int, bytes]):
    def decode(ids):
        return b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")
    return decode


def _run(stream: TextStream, ids: list[int]) -> list[str]:
    deltas = []
    for n in range(1, len(ids) + 1):
        deltas.append(stream.update(ids[:n]))
        if stream.stopped:
            return deltas
    deltas.append(stream.flush())
    return deltas


WORDS = {1: b"Hello", 2: b",", 3: b" wor", 4: b"ld", 5: b"!", 6: b" ST", 7: b"OP", 8: b" more", 9: b"S",
         10: b"TOP", 11: b" caf", 12: b"\xc3", 13: b"\xa9", 14: b"\xe2", 15: b"\x82", 16: b"\xac", 17: b"x"}


def test_text_stream_deltas_concatenate_to_text():
    decode = _byte_decoder(WORDS)
    ids = [1, 2, 3, 4, 5, 8]
    stream = TextStream(decode)
    deltas = _run(stream, ids)
    assert "".join(deltas) == decode(ids) == "Hello, world! more"
    assert stream.text == decode(ids)
    assert not stream.stopped
    # without stop strings nothing is held back
    assert deltas[:3] == ["Hello", ",", " wor"]


def test_text_stream_deltas_with_stop_strings_that_never_match():
    decode = _byte_decoder(WORDS)
    ids = [1, 2, 3, 4, 5, 8]
    stream = TextStream(decode, ("never", "xyz"))
    deltas = _run(stream, ids)
    assert "".join(deltas) == decode(ids)
    assert not stream.stopped


@pytest.mark.parametrize("ids", [[1, 3, 6, 7, 8], [1, 3, 6, 9, 10, 8], [1, 6, 7]])
def test_stop_string_truncates_and_is_never_emitted(ids):
    decode = _byte_decoder(WORDS)
    stream = TextStream(decode, ("STOP",))
    full = decode(ids)
    expected = full[:full.index("STOP")]
    emitted = ""
    for n in range(1, len(ids) + 1):
        emitted += stream.update(ids[:n])
        # only text that is certainly before the stop string is released, never a part of it
        assert expected.startswith(emitted)
        if stream.stopped:
            break
    assert stream.stopped
    assert stream.text == expected
    assert emitted == expected
    assert stream.flush() == ""


def test_stop_string_split_in_single_characters():
    vocab = {i + 1: c.encode() for i, c in enumerate("ab<end>cd")}
    decode = _byte_decoder(vocab)
    ids = list(vocab)
    stream = TextStream(decode, ("<end>",))
    deltas = _run(stream, ids)
    assert stream.stopped
    assert "".join(deltas) == "ab" == stream.text
    assert not any("<" in d for d in deltas)


def test_earliest_of_several_stop_strings_wins():
    vocab = {1: b"one ", 2: b"two ", 3: b"three"}
    decode = _byte_decoder(vocab)
    stream = TextStream(decode, ("three", "two"))
    deltas = _run(stream, [1, 2, 3])
    assert stream.stopped
    assert "".join(deltas) == "one " == stream.text


def test_multibyte_character_is_not_emitted_half_way():
    decode = _byte_decoder(WORDS)
    stream = TextStream(decode)
    assert stream.update([11]) == " caf"
    assert stream.update([11, 12]) == ""  # first byte of "é" only
    assert stream.update([11, 12, 13]) == "é"
    assert stream.update([11, 12, 13, 14]) == ""  # 1 of 3 bytes of "€"
    assert stream.update([11, 12, 13, 14, 15]) == ""  # 2 of 3
    assert stream.update([11, 12, 13, 14, 15, 16]) == "€"
    assert stream.update([11, 12, 13, 14, 15, 16, 17]) == "x"
    assert stream.text == " café€x"
    assert stream.flush() == ""


def test_multibyte_character_with_stop_string_holdback():
    decode = _byte_decoder(WORDS)
    stream = TextStream(decode, ("zz",))
    ids = [11, 12, 13, 14, 15, 16, 17, 8]
    emitted = []
    for n in range(1, len(ids) + 1):
        delta = stream.update(ids[:n])
        assert "\ufffd" not in delta
        emitted.append(delta)
    emitted.append(stream.flush())
    assert "".join(emitted) == " café€x more"


def test_partial_blocks_are_kept_matched_by_prefix_and_forgotten_on_eviction():
    bm = BlockManager(2, BS)
    [tail] = bm.allocate(1)
    bm.register_partial(tail, parent=123, token_ids=[7, 8, 9])
    bm.release([tail])
    assert bm.match_partial(123, [7, 8, 9, 10]) == (tail, 3)
    assert bm.match_partial(123, [7, 8]) is None  # the kept rows must all be a prefix
    assert bm.match_partial(999, [7, 8, 9]) is None  # after another parent: a different prefix
    bm.allocate(2)  # needs both blocks: the kept partial block is evicted
    assert bm.match_partial(123, [7, 8, 9]) is None
    assert bm.evicted_blocks == 1
