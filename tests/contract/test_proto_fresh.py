"""The committed generated stubs equal what tools/gen_proto.py produces from proto/ now."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_fresh(tmp_path):
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "tools" / "gen_proto.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    fresh = {p.name: p.read_text() for p in gen.generate(tmp_path / "_proto")}
    committed_dir = ROOT / "services" / "flywheel" / "_proto"
    committed = {
        p.name: p.read_text() for pattern in ("*.py", "*.pyi") for p in committed_dir.glob(pattern)
    }
    assert set(fresh) == set(committed), "run: python tools/gen_proto.py"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale generated stubs {stale}; run: python tools/gen_proto.py"


def test_stream_payload_field_is_sample():
    from flywheel.core.streams import FIELD

    assert FIELD == b"sample"
