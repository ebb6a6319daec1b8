"""The folders written for engines that join (`checkpoint_dir/joiners/`) are a cache of the
broadcast snapshot the trainer keeps in memory: a trainer that starts has none, so whatever an
earlier run left there is deleted when its pusher is built. Kept, those folders outranked the
new run's versions, so writing the second new version deleted the first one at once (the
newest two kept were the stale ones and the one just written), while an engine that joined
could still be loading it, and the stale copies of the model were never deleted."""

from __future__ import annotations

import torch

from flywheel.core.settings import load_settings
from flywheel.trainer.distributed_push import DistributedPusher
from flywheel.trainer.policy import build_pusher


def test_a_new_pusher_deletes_the_joiner_folders_an_earlier_run_left(tmp_path, tiny_model_dir):
    ckpt = tmp_path / "ckpt"
    stale = [ckpt / "joiners" / "weights" / f"v_{v:08d}" for v in (49, 50)]
    for folder in stale:
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"weights of an earlier run")
    settings = load_settings(
        trainer={
            "model_path": str(tiny_model_dir),
            "checkpoint": {"dir": str(ckpt)},
            "push": {"mode": "distributed", "engine_urls": ["http://127.0.0.1:9"]},
        }
    )
    pusher = build_pusher(settings)
    try:
        assert isinstance(pusher, DistributedPusher)
        assert not any(folder.exists() for folder in stale)

        written = []
        for version in (11, 12):  # two broadcasts, each then wanted by an engine that joined
            pusher.latest_snapshot = (version, {"w": torch.full((2,), float(version))})
            path, got = pusher.latest_folder()
            assert got == version
            written.append(path)
        assert all((path / "model.safetensors").is_file() for path in written), written
        assert sorted(p.name for p in (ckpt / "joiners" / "weights").iterdir()) == [
            "v_00000011",
            "v_00000012",
        ]
    finally:
        pusher.close()
