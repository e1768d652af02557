"""The data-path tester's checkpoints (tests/datapath_model.py): a run stopped and resumed from its
last checkpoint does exactly what the same run does without a stop.

On a local directory (the engine's own check of its model), so it needs no cluster: what is
tested is the engine's state, saved and restored, not stripefs.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the engine and its CLI
from datapath_model import Engine, Stopped, Target, load_checkpoint  # noqa: E402

OPS, EVERY, STOP_AT = 900, 200, 530


@pytest.mark.parametrize("use_mmap", [True, False])
def test_a_resumed_run_does_what_an_unbroken_one_does(tmp_path, use_mmap):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    unbroken = Engine(Target(dir=tmp_path / "a"), 73, use_mmap=use_mmap)
    unbroken.run(OPS)

    ckpt = tmp_path / "run.ckpt"
    first = Engine(Target(dir=tmp_path / "b"), 73, use_mmap=use_mmap, checkpoint=ckpt, checkpoint_every=EVERY)
    first.stop = types.SimpleNamespace(is_set=lambda: first.op >= STOP_AT)  # the process "dies" at STOP_AT
    with pytest.raises(Stopped):
        first.run(OPS)
    state = load_checkpoint(ckpt)
    assert (state["op"], state["done"]) == (STOP_AT // EVERY * EVERY, False)
    assert state["file_index"] != 0  # (seed 73) the run resumes on a file that is not the first
    for f in first.files:  # what the dead process left on disk is not what the checkpoint modelled
        f.path.write_bytes(b"left behind by the process that died")

    second = Engine(Target(dir=tmp_path / "b"), 73, use_mmap=use_mmap, checkpoint=ckpt, checkpoint_every=EVERY)
    second.restore(state)
    res = second.run(OPS)

    assert [bytes(f.model) for f in second.files] == [bytes(f.model) for f in unbroken.files]
    assert [f.path.read_bytes() for f in second.files] == [bytes(f.model) for f in unbroken.files]
    assert second.counts == unbroken.counts  # the same operations, each counted once
    assert res["segments"] == 2 and res["ops"] == OPS
    assert load_checkpoint(ckpt)["done"]


def test_a_checkpoint_of_another_run_is_refused(tmp_path):
    ckpt = tmp_path / "run.ckpt"
    Engine(Target(dir=tmp_path), 5, checkpoint=ckpt, checkpoint_every=100).run(150)
    with pytest.raises(ValueError, match="seed 5"):
        Engine(Target(dir=tmp_path), 6).restore(load_checkpoint(ckpt))
