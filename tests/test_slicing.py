"""One grammar and one set of sentences for a slice, whichever holds the values: a paused
training's torch tensor or a dump's numpy array (a replay)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tensordbg.sources.slicing import SliceError, apply_index, parse_index

REFUSED = [
    ("[::-1]", "cannot read slice '::-1': a slice's step is a whole number from 1 up (a tensor "
               "is not read backwards), not -1"),
    ("[::0]", "cannot read slice '::0': a slice's step is a whole number from 1 up (a tensor "
              "is not read backwards), not 0"),
    ("[20]", "[20] does not fit a tensor of shape 16x64: index 20 is out of range for a dim of "
             "size 16"),
    ("[:, [0, 64]]", "[:, [0, 64]] does not fit a tensor of shape 16x64: index 64 is out of "
                     "range for a dim of size 64"),
    ("[0, 0, 0]", "[0, 0, 0] does not fit a tensor of shape 16x64: [0, 0, 0] has 3 indices for "
                  "2 dims"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "said"), REFUSED)
def test_live_and_replay_refuse_a_slice_with_the_same_sentence(text: str, said: str) -> None:
    """The trial: on a 16x64 tensor [::-1] was refused live (torch: "step must be greater than
    zero") and taken in a replay (numpy reads it backwards); [20] said "index 20 is out of range"
    live and "out of bounds for axis 0" in a replay; [::0] said "slice step cannot be zero"
    without the sentence's usual start."""
    for values in (torch.zeros(16, 64), np.zeros((16, 64), np.float32)):
        with pytest.raises(SliceError) as refused:
            apply_index(values, parse_index(text))
        assert str(refused.value) == said, type(values).__name__


def test_what_one_takes_the_other_takes_with_the_same_shape() -> None:
    for text in ("[3]", "[-16]", "[1:7:2, 1:]", "[3:1]", "[None, 2]", "[..., [0, -1]]"):
        index = parse_index(text)
        live = apply_index(torch.zeros(16, 64), index)
        dumped = apply_index(np.zeros((16, 64), np.float32), index)
        assert tuple(live.shape) == dumped.shape, text
