import pytest

from zeroshard.partition import Piece, check_tiling, chunk_size, pieces, shard_range, shard_ranges

TIER = "default"  # docs/TESTING.md


@pytest.mark.parametrize("numel", [0, 1, 2, 5, 7, 16, 17, 1000, 1001])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8, 16, 33])
def test_ranges_tile_exactly_with_equal_chunks(numel, world):
    ranges = shard_ranges(numel, world)
    assert len(ranges) == world
    check_tiling(ranges, numel)
    size = chunk_size(numel, world)
    for rank, (start, end) in enumerate(ranges):
        assert start == min(rank * size, numel)
        assert end - start <= size
    # every non-empty range but the last non-empty one is a full chunk
    full = [e - s for s, e in ranges if e > s][:-1]
    assert all(n == size for n in full)


def test_known_values():
    assert shard_ranges(10, 4) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert shard_ranges(5, 4) == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert shard_range(3, 8, 7) == (3, 3)


def test_bad_arguments():
    with pytest.raises(ValueError):
        chunk_size(10, 0)
    with pytest.raises(ValueError):
        shard_range(10, 4, 4)


@pytest.mark.parametrize("old,new", [(4, 16), (16, 4), (4, 3), (3, 5), (1, 7), (7, 1)])
def test_pieces_reassemble_every_new_range(old, new):
    numel = 1003
    sources = shard_ranges(numel, old)
    data = list(range(numel))
    for target in shard_ranges(numel, new):
        assembled = []
        for piece in pieces(target, sources):
            start = sources[piece.source][0] + piece.source_offset
            assembled.extend(data[start:start + piece.length])
        assert assembled == data[target[0]:target[1]]


def test_pieces_detect_gaps_and_overlaps():
    with pytest.raises(ValueError, match="gap"):
        pieces((0, 10), [(0, 4), (5, 10)])
    with pytest.raises(ValueError, match="overlap"):
        pieces((0, 10), [(0, 6), (4, 10)])
    with pytest.raises(ValueError, match="gap"):
        pieces((0, 10), [(0, 9)])
    assert pieces((2, 4), [(0, 3), (3, 10)]) == [Piece(0, 2, 0, 1), Piece(1, 0, 1, 1)]


def test_check_tiling_messages():
    with pytest.raises(ValueError, match="not covered"):
        check_tiling([(0, 3), (4, 6)], 6)
    with pytest.raises(ValueError, match="overlap"):
        check_tiling([(0, 3), (2, 6)], 6)
    with pytest.raises(ValueError, match="outside"):
        check_tiling([(0, 7)], 6)


@pytest.mark.parametrize("numel,world", [(0, 3), (1, 4), (10, 4), (1003, 16), (5, 4), (4096, 1024), (4096, 1000)])
def test_holders_are_exactly_the_overlapping_ranks(numel, world):
    from zeroshard.partition import holders

    ranges = shard_ranges(numel, world)
    for start, end in [(0, numel), (0, 1), (numel // 3, numel // 2 + 1), (numel - 1, numel), (2, 2)]:
        expected = [(r, rng) for r, rng in enumerate(ranges)
                    if rng[1] > rng[0] and max(rng[0], start) < min(rng[1], end)]
        assert holders(numel, world, start, end) == expected


def test_the_bucket_planner_fills_groups_in_order_and_isolates_oversized_items():
    from zeroshard.bucketing import greedy_groups

    assert greedy_groups([3, 3, 3, 3], int, 6) == [[3, 3], [3, 3]]
    assert greedy_groups([2, 9, 1, 1], int, 4) == [[2], [9], [1, 1]]  # oversized alone, order kept
    assert greedy_groups([], int, 4) == []
    assert greedy_groups([0, 0, 5], int, 4) == [[0, 0], [5]]
    sizes = [7, 1, 4, 4, 2, 8, 3, 3, 3]
    groups = greedy_groups(sizes, int, 8)
    assert [x for g in groups for x in g] == sizes
    assert all(sum(g) <= 8 or len(g) == 1 for g in groups)
    # greedy: no group could have taken the next group's first item
    assert all(sum(a) + b[0] > 8 for a, b in zip(groups, groups[1:]))


# --- the vectorised form (zeroshard.partition_arrays) agrees with the scalar rule ---

def test_owning_ranks_and_rank_ranges_agree_with_shard_range():
    from zeroshard.partition import owning_ranks, rank_ranges

    for numel in (0, 1, 5, 7, 16, 1001):
        for world in (1, 2, 3, 8, 33):
            full, nonempty = owning_ranks(numel, world)
            ranges = shard_ranges(numel, world)
            assert [r for r in range(world) if ranges[r][1] - ranges[r][0] == chunk_size(numel, world)
                    and numel] == list(range(full))
            assert [r for r in range(world) if ranges[r][1] > ranges[r][0]] == list(range(nonempty))
            for rank in range(world):
                assert rank_ranges([numel, numel + 3], world, rank) == [shard_range(numel, world, rank),
                                                                        shard_range(numel + 3, world, rank)]


def test_arrays_agree_with_scalar_rule_on_random_layouts():
    import random

    import numpy as np

    from zeroshard import partition_arrays as pa
    from zeroshard.partition import holders

    rng = random.Random(20)
    for _ in range(200):
        rows = rng.randint(0, 12)
        numel = [rng.choice([0, 1, rng.randint(0, 50), rng.randint(0, 5000)]) for _ in range(rows)]
        world = [rng.randint(1, 40) for _ in range(rows)]
        rank = [rng.randrange(w) for w in world]
        starts, ends = pa.shard_ranges(numel, world, rank)
        assert list(zip(starts.tolist(), ends.tolist())) == [shard_range(n, w, r)
                                                            for n, w, r in zip(numel, world, rank)]
        lo = [rng.randint(0, n) for n in numel]
        hi = [rng.randint(a, n) for a, n in zip(lo, numel)]
        found = pa.holders(numel, np.asarray(world), lo, hi)
        expected = [(i, r, s, max(s, a), min(e, b)) for i, (n, w, a, b) in enumerate(zip(numel, world, lo, hi))
                    for r, (s, e) in holders(n, w, a, b)]
        got = list(zip(*(c.tolist() for c in (found.row, found.rank, found.rank_start, found.lo, found.hi))))
        assert got == expected


def test_intersect_layouts_reassembles_every_target_range():
    import numpy as np

    from zeroshard.partition_arrays import intersect_layouts

    numel = np.array([0, 1, 7, 1003, 64])
    for old, new in [(4, 16), (16, 4), (4, 3), (3, 5), (1, 7), (7, 1)]:
        tensor, target, found = intersect_layouts(numel, old, new)
        for t, n in enumerate(numel.tolist()):
            for r, (start, end) in enumerate(shard_ranges(n, new)):
                mine = (tensor == t) & (target == r)
                expected = [(p.source, sources_start + p.source_offset, p.length)
                            for sources_start, p in ((shard_ranges(n, old)[p.source][0], p)
                                                     for p in pieces((start, end), shard_ranges(n, old)))]
                got = [(q, lo, hi - lo) for q, lo, hi in zip(found.rank[mine].tolist(), found.lo[mine].tolist(),
                                                              found.hi[mine].tolist())]
                assert got == expected


def test_bad_arguments_arrays():
    from zeroshard import partition_arrays as pa

    with pytest.raises(ValueError):
        pa.chunk_sizes([10], 0)
    with pytest.raises(ValueError):
        pa.shard_ranges([10], 4, [4])


def test_the_rule_is_stated_only_in_partition():
    """No module re-derives the rule: no division by a world size or chunk size, and no
    `rank * chunk`, outside zeroshard/partition*.py (they call it instead)."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1] / "zeroshard"
    pattern = re.compile(r"//\s*\(?\s*[\w.\[\]]*(world|chunk)|\brank\w*\s*\*\s*[\w.]*(chunk|size)\b"
                         r"|\b(chunk|size)\w*\s*\*\s*rank")
    # the engine's padded [world, chunk] row blocks are torch views sized by chunk_size, not ranges
    exempt = {"engine/layout.py"}
    found = [f"{path.relative_to(root)}:{number}: {line.strip()}"
             for path in sorted(root.rglob("*.py"))
             if not path.name.startswith("partition") and str(path.relative_to(root)) not in exempt
             for number, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "the partition rule restated outside zeroshard/partition*.py:\n" + "\n".join(found)
    # the scan itself finds a restatement
    assert pattern.search("    c = -(-n // world_size)") and pattern.search("start = rank * chunk")
