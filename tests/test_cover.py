"""The exact-cover check of a tensor's stored chunks: right on every layout, and bounded work on big ones.

``check_exact_cover`` must refuse chunks that overlap (even when their sizes add up to the tensor's), leave a
gap or stick out, and accept every exact tiling. Its work is counted, not timed: it returns the number of
pairwise tests its sweep made, which must stay linear in the number of chunks for a tensor split along any
one dimension or in a grid along two (the quadratic check it replaces took 15 s for 5,000 pieces along dim 1
of a ``[1, N]`` tensor, from a 274 KB chunk index).
"""

from __future__ import annotations

import itertools
import json
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptio import CheckpointCorruptError
from ckptio.formats.safetensors import chunk_index, sharded as safetensors_sharded
from ckptio.formats import cover
from ckptio.formats.common import check_exact_cover
from ckptio.storage.checksum import bytes_checksum


def _brute(shape: tuple[int, ...], boxes: list) -> str | None:
    """What is wrong with ``boxes``, by counting every element: ``"fit"``, ``"overlap"``, ``"gap"`` or ``None``."""
    counts = np.zeros(shape, dtype=np.int64)
    for o, s, _ in boxes:
        if any(a < 0 or n < 0 or a + n > g for a, n, g in zip(o, s, shape)):
            return "fit"
        counts[tuple(slice(a, a + n) for a, n in zip(o, s))] += 1
    if (counts > 1).any():
        return "overlap"
    return "gap" if (counts == 0).any() else None


@st.composite
def _layouts(draw) -> tuple[tuple[int, ...], list]:
    """A tensor of 0-4 dimensions, tiled by a grid of cuts (an exact cover), then perhaps damaged."""
    dims = draw(st.integers(0, 4))
    shape = tuple(draw(st.integers(1, 5)) for _ in range(dims))
    cuts = [sorted({0, g, *draw(st.lists(st.integers(1, max(1, g - 1)), max_size=3))}) for g in shape]
    boxes = [(tuple(c[i] for c, i in zip(cuts, idx)), tuple(c[i + 1] - c[i] for c, i in zip(cuts, idx)), f"f{n}")
             for n, idx in enumerate(itertools.product(*[range(len(c) - 1) for c in cuts]))]
    damage = draw(st.sampled_from(["none", "duplicate", "drop", "grow", "shift", "random"]))
    if damage == "duplicate" and boxes:
        boxes.append(draw(st.sampled_from(boxes)))
    elif damage == "drop" and len(boxes) > 1:
        boxes.pop(draw(st.integers(0, len(boxes) - 1)))
    elif damage in ("grow", "shift") and dims:
        i, d = draw(st.integers(0, len(boxes) - 1)), draw(st.integers(0, dims - 1))
        o, s, src = boxes[i]
        step = draw(st.sampled_from([-1, 1]))
        o, s = (list(o), list(s))
        (s if damage == "grow" else o)[d] += step
        boxes[i] = (tuple(o), tuple(s), src)
    elif damage == "random":
        for _ in range(draw(st.integers(1, 3))):
            o = tuple(draw(st.integers(0, g - 1)) for g in shape)
            boxes.append((o, tuple(draw(st.integers(1, g - a)) for a, g in zip(o, shape)), "extra"))
    draw(st.randoms()).shuffle(boxes)
    return shape, boxes


@settings(max_examples=400, deadline=None)
@given(_layouts())
def test_the_check_agrees_with_counting_every_element(layout):
    shape, boxes = layout
    wrong = _brute(shape, boxes)
    if wrong is None:
        check_exact_cover("w", shape, boxes, "here")
        return
    with pytest.raises(CheckpointCorruptError, match={"fit": "does not fit", "overlap": "overlap|stored",
                                                      "gap": "cover"}[wrong]):
        check_exact_cover("w", shape, boxes, "here")


def test_overlapping_chunks_whose_sizes_add_up_are_refused_in_every_dimension():
    # rows 0-2 and row 1 again: 4 rows for a 4-row tensor, row 3 missing; then the same along dim 1 of [3, 4]
    with pytest.raises(CheckpointCorruptError, match=r"overlap.*a.*b"):
        check_exact_cover("w", (4, 2), [((0, 0), (3, 2), "a"), ((1, 0), (1, 2), "b")], "here")
    with pytest.raises(CheckpointCorruptError, match=r"overlap"):
        check_exact_cover("w", (3, 4), [((0, 0), (3, 3), "a"), ((0, 2), (3, 1), "b")], "here")
    # a 2x2 grid with one quarter stored twice and another missing, in three dimensions
    grid = [((i, j, 0), (1, 1, 2), f"{i}{j}") for i in range(2) for j in range(2)]
    with pytest.raises(CheckpointCorruptError, match=r"overlap"):
        check_exact_cover("w", (2, 2, 2), grid[:3] + [grid[0]], "here")


def _pieces_along(dim: int, n: int, dims: int = 2) -> tuple[tuple[int, ...], list]:
    shape = tuple(n if d == dim else 1 for d in range(dims))
    return shape, [(tuple(i if d == dim else 0 for d in range(dims)), tuple(1 if d == dim else shape[d]
                   for d in range(dims)), f"f{i}") for i in range(n)]


@pytest.mark.parametrize("dims,dim", [(2, 0), (2, 1), (3, 2)])
def test_a_split_along_any_one_dimension_takes_linear_work(dims, dim):
    shape, boxes = _pieces_along(dim, 5000, dims)
    random.Random(0).shuffle(boxes)
    assert check_exact_cover("w", shape, boxes, "here") <= len(boxes)


@pytest.mark.parametrize("rows,cols", [(70, 70), (8, 600), (600, 8)])
def test_a_grid_along_two_dimensions_takes_linear_work(rows, cols):
    boxes = [((i * 3, j * 2, 0), (3, 2, 4), f"{i}.{j}") for i in range(rows) for j in range(cols)]
    random.Random(1).shuffle(boxes)
    assert check_exact_cover("w", (rows * 3, cols * 2, 4), boxes, "here") <= 2 * len(boxes)
    boxes.append(((rows * 3 - 3, cols * 2 - 2, 0), (3, 2, 4), "stale"))  # the last piece again
    with pytest.raises(CheckpointCorruptError, match="overlap.*stale|stale.*overlap"):
        check_exact_cover("w", (rows * 3, cols * 2, 4), boxes, "here")


def test_uneven_pieces_in_two_dimensions_take_linear_work():
    """Each row of a [rows, 1000] tensor cut at its own column (no grid): at most two tests per piece."""
    rng = random.Random(2)
    boxes = []
    for r in range(2500):
        cut = rng.randint(1, 999)
        boxes += [((r, 0), (1, cut), f"{r}a"), ((r, cut), (1, 1000 - cut), f"{r}b")]
    rng.shuffle(boxes)
    assert check_exact_cover("w", (2500, 1000), boxes, "here") <= 2 * len(boxes)


# ----------------------------------------------------------------------------------------- through the index
def _reseal_with(folder: Path, key: str, shape: list[int], rows: list[list[int]]) -> None:
    """Add tensor ``key`` with chunk ``rows`` to the folder's index and re-seal it (a valid checksum)."""
    path = folder / chunk_index.INDEX_NAME
    first, _, body = path.read_bytes().partition(b"\n")
    head = json.loads(first)
    meta = json.loads(body[:head["meta_bytes"]])
    table = np.frombuffer(body, dtype="<i8", offset=head["meta_bytes"]).tolist()
    meta["tensors"][key] = ["float32", shape, len(table), len(rows)]
    for row in rows:
        table.extend(row)
    raw = json.dumps(meta).encode()
    raw += b" " * (-len(raw) % 8)
    new = raw + np.asarray(table, dtype="<i8").tobytes()
    head.update(meta_bytes=len(raw), body_bytes=len(new), body_crc32c=bytes_checksum(new))
    path.write_bytes(json.dumps(head).encode() + b"\n" + new)


@pytest.mark.parametrize("layout", ["along dim 1", "a grid"])
def test_a_big_resealed_index_is_checked_with_bounded_work(tmp_path, layout, monkeypatch):
    safetensors_sharded.save({"a": torch.zeros(4, 4)}, tmp_path, rank=0, world_size=1)
    if layout == "along dim 1":
        n = 18_000
        shape, rows = [1, n], [[0, 0, i, 1, 1, 4 * i, 4 * i + 4] for i in range(n)]
    else:
        tall, wide = 4, 4225  # a grid of pieces, 1x1 each, much wider than tall
        shape = [tall, wide]
        rows = [[0, i, j, 1, 1, 4 * (i * wide + j), 4 * (i * wide + j) + 4] for i in range(tall) for j in range(wide)]
    _reseal_with(tmp_path, "big", shape, rows)
    assert (tmp_path / chunk_index.INDEX_NAME).stat().st_size > 900_000
    made = []
    sweep = cover.find_overlap

    def counted(*args):  # the real sweep, its tests recorded
        pair, tests = sweep(*args)
        made.append(tests)
        return pair, tests

    monkeypatch.setattr(cover, "find_overlap", counted)
    start = time.perf_counter()
    index = safetensors_sharded.read_index(tmp_path)
    elapsed = time.perf_counter() - start
    assert "big" in index and sum(made) <= 2 * len(rows)
    assert made or layout == "along dim 1"  # a split along one dimension is checked by a sort in numpy
    print(f"{layout}: {len(rows)} pieces checked in {elapsed:.3f} s with {sum(made)} pairwise tests")
